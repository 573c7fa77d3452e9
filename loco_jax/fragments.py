"""Splitting a parameter tree into the fragments that Streaming DiLoCo syncs one at a time.

A plan assigns every parameter value to exactly one of ``P`` fragments:

- fragment 0 holds every leaf that is not in a transformer block
  (embeddings, final norm, head);
- the ``L`` blocks are spread over fragments ``1 .. P-1``:

  ``strided`` (the default; it beat sequential in the paper)::

      block i -> 1 + i mod (P - 1)

  ``sequential`` (contiguous groups, uneven sizes allowed)::

      block i -> 1 + floor(i * (P - 1) / L)

- ``P = 1`` puts everything in fragment 0 (vanilla DiLoCo).

The paper's 1B model has 24 blocks and ``P = 9``: three blocks per fragment
(strided: fragment 1 holds blocks 0, 8 and 16).

Blocks are found from each leaf's tree path (every key turned into a string,
and split further at ``.`` and ``/``, so flat names such as
``"layers.3.attn.wq"`` work too):

- unrolled: a component ``layers_3``, ``layer_3``, ``blocks_3``, ``block_3``,
  ``h_3`` (or ``layers.3``), or a component named ``layers``, ``layer``,
  ``blocks``, ``block`` or ``h`` followed by an integer component, e.g.
  ``('layers', 3, 'attn', 'wq', 'kernel')`` or ``blocks/3/mlp/...``: block 3;
- scanned: a component named exactly ``layers`` or ``blocks``
  (case-insensitive) *not* followed by an integer: the leaf is stacked on a
  leading layer axis and each slice ``leaf[i]`` belongs to block ``i``;
- anything else is a non-block leaf (fragment 0).

The first component that matches decides. Block indices must be ``0 .. L-1``.
``labels=`` replaces detection by an explicit assignment.

``extract`` / ``insert`` gather a fragment into one flat fp32 vector and scatter
it back; their indices are static NumPy, so they work under ``jax.jit`` (a
plan is hashable and can also be a static argument). Order: leaves in
``jax.tree.flatten`` order, and within a scanned leaf the fragment's slices in
increasing order.

Reference: docs/algorithms.md, "6. DiLoCo and Streaming DiLoCo" (Fragments); Streaming DiLoCo
(arXiv 2501.18512), section 2.2 and its strided vs sequential ablation.

Nothing here is specific to one model: blocks are found by their paths. The LLaMA-style
tree the trainer uses is described in :mod:`loco_jax.training.shapes`.

Why one module of this size: block detection, assignment and the flatten / insert of a fragment are
one plan object's parts, tested together.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from loco_jax.checks import is_int, require_int

Strategy = Literal["strided", "sequential"]
STRATEGIES = get_args(Strategy)

_BLOCK_NAMES = ("layers", "layer", "blocks", "block", "h")  # followed by an integer: an unrolled block
_SCAN_NAMES = ("layers", "blocks")  # not followed by an integer: a scanned (stacked) leaf
_BLOCK_RE = re.compile(r"^(?:layers|layer|blocks|block|h)_(\d+)$", re.IGNORECASE)
_INT_RE = re.compile(r"^\d+$")

# ---------------------------------------------------------------------------
# Paths and shapes
# ---------------------------------------------------------------------------


def _key_str(k) -> str:
    if isinstance(k, DictKey):
        return str(k.key)
    if isinstance(k, GetAttrKey):
        return str(k.name)
    if isinstance(k, SequenceKey):
        return str(k.idx)
    if isinstance(k, FlattenedIndexKey):
        return str(k.key)
    return str(k)


def path_str(path) -> str:
    """``'layers/3/attn/wq/kernel'`` for a ``tree_flatten_with_path`` key path."""
    return "/".join(_key_str(k) for k in path) or "<root>"


def _tokens(path) -> list[str]:
    out = []
    for k in path:
        out.extend(t for t in re.split(r"[./]", _key_str(k)) if t)
    return out


def _block_of(path):
    """``('block', i)``, ``('scanned', None)`` or ``(None, None)`` for one leaf path."""
    toks = _tokens(path)
    for j, t in enumerate(toks):
        m = _BLOCK_RE.match(t)
        if m:
            return "block", int(m.group(1))
        low = t.lower()
        nxt_int = j + 1 < len(toks) and _INT_RE.match(toks[j + 1]) is not None
        if low in _BLOCK_NAMES and nxt_int:
            return "block", int(toks[j + 1])
        if low in _SCAN_NAMES and not nxt_int:
            return "scanned", None
    return None, None


def is_stacked(path) -> bool:
    """Whether the leaf at ``path`` is a scanned stack (its dim 0 is the layer axis), by the rules above."""
    return _block_of(path)[0] == "scanned"


def _shape(leaf) -> tuple[int, ...]:
    return tuple(int(d) for d in (leaf.shape if hasattr(leaf, "shape") else np.shape(leaf)))


def _dtype(leaf):
    return np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.asarray(leaf).dtype


def count_params(tree) -> int:
    """Number of values in a tree of arrays or ``jax.ShapeDtypeStruct`` (nothing is allocated)."""
    return int(sum(math.prod(_shape(x)) for x in jax.tree.leaves(tree)))


def _as_index(idx: np.ndarray, length: int):
    """A static index for the sorted slice indices ``idx`` of an axis of ``length``.

    ``None`` means the whole leaf; an arithmetic progression becomes a Python
    slice (a strided slice in HLO rather than a gather); anything else stays an
    index array.
    """
    k = len(idx)
    if k == length and np.array_equal(idx, np.arange(length)):
        return None
    if k == 1:
        return slice(int(idx[0]), int(idx[0]) + 1)
    step = int(idx[1] - idx[0])
    if step > 0 and np.all(np.diff(idx) == step):
        return slice(int(idx[0]), int(idx[-1]) + 1, step)
    return idx


def _fmt_ints(xs) -> str:
    return ", ".join(str(int(x)) for x in xs)


# ---------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class FragmentPlan:
    """Which fragment every parameter value belongs to. Immutable and hashable.

    Attributes:
      num_fragments: ``P``.
      leaf_labels: per leaf, in ``jax.tree.flatten`` order: an ``int`` (the whole
        leaf's fragment) or a read-only NumPy int array of shape ``(L,)`` (the
        fragment of each slice along axis 0, for a scanned leaf).
      treedef: the tree structure of the params the plan was built for.
      leaf_paths: ``'a/b/c'`` path string of every leaf.
      leaf_shapes: shape of every leaf.
      num_layers: number of transformer blocks found (0 when ``labels=`` was
        given or ``P = 1``).
      block_labels: fragment of each block ``0 .. num_layers-1`` (empty when
        ``num_layers`` is 0).
    """

    num_fragments: int
    leaf_labels: tuple
    treedef: Any
    leaf_paths: tuple[str, ...]
    leaf_shapes: tuple[tuple[int, ...], ...]
    num_layers: int = 0
    block_labels: tuple[int, ...] = ()
    leaf_blocks: tuple = ()  # per leaf: None (non-block), int (unrolled block) or "scanned"; for describe()
    _pieces: tuple = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        P = self.num_fragments
        pieces = [[] for _ in range(P)]  # per fragment: (leaf index, static index or None, number of values)
        for i, (lab, shape) in enumerate(zip(self.leaf_labels, self.leaf_shapes)):
            if isinstance(lab, np.ndarray):
                inner = math.prod(shape[1:])
                for p in np.unique(lab):
                    idx = np.flatnonzero(lab == p)
                    pieces[int(p)].append((i, _as_index(idx, shape[0]), len(idx) * inner, idx))
            else:
                pieces[lab].append((i, None, math.prod(shape), None))
        object.__setattr__(self, "_pieces", tuple(tuple(x) for x in pieces))

    # -- identity ----------------------------------------------------------

    def _key(self):
        labs = tuple(("slices", tuple(int(v) for v in x)) if isinstance(x, np.ndarray) else x for x in self.leaf_labels)
        return (self.num_fragments, self.treedef, labs, self.leaf_shapes)

    def __eq__(self, other):
        return isinstance(other, FragmentPlan) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    # -- sizes -------------------------------------------------------------

    def _check_p(self, p) -> int:
        if not is_int(p) or not 0 <= p < self.num_fragments:
            raise ValueError(
                f"fragment index p={p!r} must be a Python int in [0, {self.num_fragments}) "
                "(a static value, not a traced one)."
            )
        return int(p)

    def fragment_sizes(self) -> tuple[int, ...]:
        """Number of parameter values in each fragment; they sum to the tree's size."""
        return tuple(int(sum(n for _, _, n, _ in ps)) for ps in self._pieces)

    def fragment_size(self, p: int) -> int:
        return self.fragment_sizes()[self._check_p(p)]

    # -- tree access ---------------------------------------------------------

    def _leaves(self, tree, what: str):
        leaves, treedef = jax.tree.flatten(tree)
        if treedef != self.treedef:
            raise ValueError(
                f"{what}: the tree's structure does not match the plan's params.\n"
                f"  plan:  {self.treedef}\n  given: {treedef}"
            )
        for leaf, shape, path in zip(leaves, self.leaf_shapes, self.leaf_paths):
            if _shape(leaf) != shape:
                raise ValueError(f"{what}: leaf {path!r} has shape {_shape(leaf)}, but the plan was built for {shape}.")
        return leaves

    def select(self, tree, p: int) -> list:
        """Per-leaf pieces of fragment ``p``, in extract order, each in its leaf's dtype.

        A whole leaf keeps its shape; a scanned leaf gives ``leaf[idx]`` of shape
        ``(k,) + leaf.shape[1:]`` with its ``k`` slices of fragment ``p`` in
        increasing order.
        """
        p = self._check_p(p)
        leaves = self._leaves(tree, "select")
        out = []
        for i, index, _, _ in self._pieces[p]:
            x = leaves[i]
            out.append(x if index is None else jnp.asarray(x)[index])
        return out

    def extract(self, tree, p: int, *, dtype=jnp.float32) -> jax.Array:
        """Fragment ``p`` of ``tree`` as one flat 1-D array, **cast to float32** (``dtype``).

        ``tree`` has the params' structure and shapes (parameters, deltas,
        optimizer moments...). Works on traced arrays under ``jax.jit`` and on
        ``ShapeDtypeStruct`` via ``jax.eval_shape``. Length: ``fragment_sizes()[p]``.
        """
        parts = [jnp.ravel(jnp.asarray(x)).astype(dtype) for x in self.select(tree, p)]
        if not parts:
            return jnp.zeros((0,), dtype)
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

    def insert(self, tree, p: int, flat) -> Any:
        """Inverse of ``extract``: ``tree`` with fragment ``p``'s values taken from ``flat``.

        ``flat`` has length ``fragment_sizes()[p]``; each piece is cast back to its
        leaf's dtype. All other values (and untouched leaves, as objects) are
        unchanged.
        """
        p = self._check_p(p)
        leaves = list(self._leaves(tree, "insert"))
        flat = jnp.asarray(flat)
        size = self.fragment_sizes()[p]
        if flat.shape != (size,):
            raise ValueError(f"insert: fragment {p} holds {size} values, but flat has shape {flat.shape}.")
        off = 0
        for i, index, n, idx in self._pieces[p]:
            leaf = leaves[i]
            shape = self.leaf_shapes[i]
            piece = flat[off : off + n]
            off += n
            dtype = _dtype(leaf)
            if index is None:
                leaves[i] = piece.reshape(shape).astype(dtype)
            else:
                leaves[i] = jnp.asarray(leaf).at[index].set(piece.reshape((len(idx),) + shape[1:]).astype(dtype))
        return jax.tree.unflatten(self.treedef, leaves)

    def mask(self, tree_like, p: int) -> Any:
        """NumPy bool arrays with the leaves' shapes: True where a value belongs to fragment ``p``.

        ``tree_like`` is any tree with the params' structure and shapes (arrays
        or ``ShapeDtypeStruct``); the masks are host memory (one byte a value).
        """
        p = self._check_p(p)
        self._leaves(tree_like, "mask")
        out = []
        for lab, shape in zip(self.leaf_labels, self.leaf_shapes):
            if isinstance(lab, np.ndarray):
                m = np.broadcast_to((lab == p).reshape((-1,) + (1,) * (len(shape) - 1)), shape).copy()
            else:
                m = np.full(shape, lab == p, dtype=bool)
            out.append(m)
        return jax.tree.unflatten(self.treedef, out)

    def fragment_blocks(self, p: int) -> tuple[int, ...]:
        """The transformer blocks in fragment ``p`` (empty for fragment 0 or without detection)."""
        p = self._check_p(p)
        return tuple(i for i, f in enumerate(self.block_labels) if f == p)

    # -- description ---------------------------------------------------------

    def describe(self, tree=None) -> str:
        """A table: fragment, number of values, share, and which leaves / layer slices it holds."""
        if tree is not None:
            self._leaves(tree, "describe")
        sizes = self.fragment_sizes()
        total = sum(sizes) or 1
        blocks = self.leaf_blocks or (None,) * len(self.leaf_labels)
        rows = []
        for p in range(self.num_fragments):
            items = []
            pb = self.fragment_blocks(p)
            if pb:
                n_leaves = sum(1 for (i, _, _, _) in self._pieces[p] if isinstance(blocks[i], int))
                n_scan = sum(1 for (i, _, _, _) in self._pieces[p] if blocks[i] == "scanned")
                what = []
                if n_leaves:
                    what.append(f"{n_leaves} leaves")
                if n_scan:
                    what.append(f"slices of {n_scan} stacked leaves")
                items.append(f"blocks {_fmt_ints(pb)} ({', '.join(what)})")
            for i, index, _, idx in self._pieces[p]:
                if pb and blocks[i] is not None:
                    continue  # summarised above
                path, shape = self.leaf_paths[i], self.leaf_shapes[i]
                if idx is None:
                    items.append(f"{path} {shape}")
                else:
                    items.append(f"{path}[{_fmt_ints(idx)}] {shape}")
            if len(items) > 12:
                items = items[:12] + [f"... and {len(items) - 12} more"]
            rows.append((str(p), f"{sizes[p]:,}", f"{100.0 * sizes[p] / total:.1f}%", items))
        w0 = max(len("fragment"), *(len(r[0]) for r in rows))
        w1 = max(len("values"), len(f"{sum(sizes):,}"), *(len(r[1]) for r in rows))
        w2 = max(len("share"), *(len(r[2]) for r in rows))
        lines = [f"{'fragment':<{w0}}  {'values':>{w1}}  {'share':>{w2}}  contents"]
        for f, n, s, items in rows:
            pad = " " * (w0 + w1 + w2 + 6)
            first = items[0] if items else "(empty)"
            lines.append(f"{f:<{w0}}  {n:>{w1}}  {s:>{w2}}  {first}")
            lines.extend(pad + it for it in items[1:])
        lines.append(f"{'total':<{w0}}  {sum(sizes):>{w1},}  {'100.0%':>{w2}}  {len(self.leaf_labels)} leaves")
        return "\n".join(lines)

    def __str__(self):
        return self.describe()


# ---------------------------------------------------------------------------
# Building a plan
# ---------------------------------------------------------------------------


def _assign_blocks(num_layers: int, num_fragments: int, strategy: Strategy) -> np.ndarray:
    i = np.arange(num_layers)
    if strategy == "strided":
        return 1 + i % (num_fragments - 1)
    return 1 + (i * (num_fragments - 1)) // num_layers


def _layer_count(unrolled, scanned, paths, num_layers):
    """``L``, the transformer blocks of a tree: the scanned leaves' common leading axis (the unrolled blocks,
    if any, exactly 0..L-1), or the unrolled blocks' contiguous count; checked against ``num_layers``."""
    if scanned:
        lengths = sorted({n for _, n in scanned})
        if len(lengths) > 1:
            detail = "; ".join(f"{paths[i]}: {n}" for i, n in scanned)
            raise ValueError(
                f"scanned leaves disagree on the number of layers (leading axis sizes {lengths}): {detail}. "
                "Every leaf under a scanned 'layers'/'blocks' subtree needs the same leading layer axis."
            )
        L = lengths[0]
        if num_layers is not None and L != num_layers:
            detail = ", ".join(paths[i] for i, _ in scanned[:4]) + (" ..." if len(scanned) > 4 else "")
            raise ValueError(
                f"num_layers={num_layers}, but the scanned leaves ({detail}) have a leading layer axis of {L}."
            )
        if unrolled and set(unrolled) != set(range(L)):
            raise ValueError(
                f"the tree mixes scanned leaves ({L} layers) with unrolled blocks {_fmt_ints(sorted(unrolled))}, "
                f"which are not exactly 0..{L - 1}; pass labels= instead."
            )
    else:
        L = max(unrolled) + 1
        missing = sorted(set(range(L)) - set(unrolled))
        if missing:
            raise ValueError(
                f"block indices must be contiguous 0..{L - 1}, but blocks {_fmt_ints(missing)} are missing "
                f"(found {_fmt_ints(sorted(unrolled))}); pass labels= for such a tree."
            )
        if num_layers is not None and L != num_layers:
            raise ValueError(f"num_layers={num_layers}, but the tree has blocks 0..{L - 1} ({L} blocks).")
    return L


def _detect(paths_raw, paths, shapes, num_fragments, strategy, num_layers):
    kinds = [_block_of(pr) for pr in paths_raw]
    unrolled = {}  # block -> leaf paths
    scanned = []  # (leaf index, L)
    for i, (kind, b) in enumerate(kinds):
        if kind == "block":
            unrolled.setdefault(b, []).append(paths[i])
        elif kind == "scanned":
            if len(shapes[i]) == 0:
                raise ValueError(
                    f"leaf {paths[i]!r} sits under 'layers'/'blocks' without a block index, so it is taken as a "
                    "scanned (stacked) leaf, but it is a scalar with no leading layer axis; pass labels= instead."
                )
            scanned.append((i, shapes[i][0]))

    if not unrolled and not scanned:
        raise ValueError(
            f"num_fragments={num_fragments} needs transformer blocks for fragments 1..{num_fragments - 1}, but the "
            "tree has no transformer blocks (no path component like 'layers_3', 'layers/3', 'blocks/3', 'h_3', "
            "or a scanned 'layers'/'blocks' subtree). Pass labels= to assign fragments explicitly, or use "
            "num_fragments=1."
        )

    L = _layer_count(unrolled, scanned, paths, num_layers)

    if num_fragments - 1 > L:
        got = set(_assign_blocks(L, num_fragments, strategy).tolist())
        empty = [p for p in range(1, num_fragments) if p not in got]
        raise ValueError(
            f"num_fragments={num_fragments} puts the {L} transformer blocks into {num_fragments - 1} fragments "
            f"(1..{num_fragments - 1}), so some fragment would be empty: fragment(s) {_fmt_ints(empty)}. "
            f"Use num_fragments <= {L + 1}."
        )

    assign = _assign_blocks(L, num_fragments, strategy)
    labels, blocks = [], []
    for i, (kind, b) in enumerate(kinds):
        if kind == "block":
            labels.append(int(assign[b]))
            blocks.append(b)
        elif kind == "scanned":
            labels.append(assign.copy())
            blocks.append("scanned")
        else:
            labels.append(0)
            blocks.append(None)
    return labels, blocks, L, tuple(int(a) for a in assign)


def _explicit_labels(labels, params, treedef, paths, shapes, num_fragments):
    if callable(labels):
        labels = labels(params)
    lab_leaves_wp, lab_def = jax.tree_util.tree_flatten_with_path(labels)
    if lab_def != treedef:
        mine = {path_str(pth) for pth, _ in lab_leaves_wp}
        theirs = set(paths)
        only_p = sorted(theirs - mine)[:5]
        only_l = sorted(mine - theirs)[:5]
        hint = ""
        if only_p:
            hint += f" Leaves of params without a label: {only_p}."
        if only_l:
            hint += f" Labels with no matching params leaf: {only_l}."
        raise ValueError(
            "labels: the label tree's structure does not match params (it needs one int, or one int array of "
            f"shape (L,) for a scanned leaf, per params leaf).{hint}\n  params: {treedef}\n  labels: {lab_def}"
        )
    out = []
    for (_, lab), path, shape in zip(lab_leaves_wp, paths, shapes):
        if isinstance(lab, bool) or isinstance(lab, np.bool_):
            raise ValueError(f"labels: leaf {path!r} has label {lab!r}; labels are fragment ints.")
        arr = np.asarray(lab)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"labels: leaf {path!r} has label {lab!r} of dtype {arr.dtype}; labels must be integers.")
        if arr.ndim == 0:
            v = int(arr)
            if not 0 <= v < num_fragments:
                raise ValueError(
                    f"labels: leaf {path!r} has label {v}, outside [0, {num_fragments}) for "
                    f"num_fragments={num_fragments}."
                )
            out.append(v)
        elif arr.ndim == 1:
            if len(shape) == 0 or arr.shape[0] != shape[0]:
                raise ValueError(
                    f"labels: leaf {path!r} has a per-slice label array of length {arr.shape[0]}, but its leading "
                    f"(layer) dimension is {shape[0] if shape else 'missing (a scalar leaf)'}; shape {shape}."
                )
            bad = arr[(arr < 0) | (arr >= num_fragments)]
            if bad.size:
                raise ValueError(
                    f"labels: leaf {path!r} has slice label(s) {_fmt_ints(np.unique(bad))}, outside "
                    f"[0, {num_fragments}) for num_fragments={num_fragments}."
                )
            a = arr.astype(np.int64)
            out.append(a)
        else:
            raise ValueError(
                f"labels: leaf {path!r} has a label of shape {arr.shape}; use an int or an int array of shape (L,)."
            )
    return out


def plan(
    params,
    num_fragments: int,
    *,
    strategy: Strategy = "strided",
    labels: Any | Callable[[Any], Any] = None,
    num_layers: int | None = None,
) -> FragmentPlan:
    """Builds the fragment plan of ``params`` (arrays or ``jax.ShapeDtypeStruct``; nothing is allocated).

    Args:
      params: the parameter pytree.
      num_fragments: ``P >= 1``.
      strategy: ``"strided"`` (block i -> 1 + i mod (P-1), the default) or
        ``"sequential"`` (block i -> 1 + floor(i (P-1) / L)).
      labels: explicit assignment instead of block detection: a pytree with
        params' structure whose leaves are ints (or int arrays of shape ``(L,)``,
        one label per slice of axis 0), or a callable ``labels(params)``
        returning one. ``strategy`` and ``num_layers`` are then unused.
      num_layers: the expected number of blocks; checked against the tree.

    Raises:
      ValueError: naming the problem (bad ``num_fragments`` or ``strategy``, no
        blocks, too few blocks, labels out of range or of the wrong structure or
        length, an empty fragment).
    """
    require_int("num_fragments", num_fragments, "a positive int (1 = vanilla DiLoCo)")
    num_fragments = int(num_fragments)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is unknown; choose one of {STRATEGIES}.")
    require_int("num_layers", num_layers, "a positive int or None", allow_none=True)

    flat_wp, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths_raw = [pth for pth, _ in flat_wp]
    paths = tuple(path_str(pth) for pth in paths_raw)
    shapes = tuple(_shape(x) for _, x in flat_wp)

    L, block_labels, blocks = 0, (), ()
    if labels is not None:
        leaf_labels = _explicit_labels(labels, params, treedef, paths, shapes, num_fragments)
    elif num_fragments == 1:
        leaf_labels = [0] * len(paths)
    else:
        leaf_labels, blocks, L, block_labels = _detect(paths_raw, paths, shapes, num_fragments, strategy, num_layers)

    # Every fragment must hold at least one leaf or slice.
    used = set()
    for lab, shape in zip(leaf_labels, shapes):
        if isinstance(lab, np.ndarray):
            used.update(int(v) for v in lab)
        else:
            used.add(lab)
    empty = [p for p in range(num_fragments) if p not in used]
    if empty:
        why = ""
        if 0 in empty and labels is None:
            why = " Fragment 0 holds the leaves outside transformer blocks, and this tree has none."
        raise ValueError(
            f"fragment(s) {_fmt_ints(empty)} of num_fragments={num_fragments} would be empty (no leaf or slice is "
            f"assigned to them).{why} Use fewer fragments or pass labels=."
        )

    frozen = []
    for lab in leaf_labels:
        if isinstance(lab, np.ndarray):
            lab = np.array(lab, dtype=np.int64)
            lab.setflags(write=False)
        frozen.append(lab)
    return FragmentPlan(
        num_fragments=num_fragments,
        leaf_labels=tuple(frozen),
        treedef=treedef,
        leaf_paths=paths,
        leaf_shapes=shapes,
        num_layers=L,
        block_labels=block_labels,
        leaf_blocks=tuple(blocks),
    )
