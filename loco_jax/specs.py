"""shard_map bookkeeping: varying axes, bound axes, and the PartitionSpec of every state leaf.

Under ``check_vma=True`` JAX types every value inside ``shard_map`` with the
mesh axes it varies over. That type says exactly how a state leaf must be laid
out in the global view: a leaf that varies over ``("replica", "data")`` holds
one block per device and is split on dim 0 over both axes; a leaf that varies
over ``"replica"`` only (DiLoCo's local parameters and inner state) is split
over ``replica``; an invariant leaf (global parameters, counters) is ``P()``.
:func:`output_specs` reads those types off an abstract trace, so users and
the trainer never guess a spec.

Global-view convention: per-device blocks are *concatenated* on dim 0 (not
stacked on a new axis), so inside ``shard_map`` every leaf keeps the shape
the optimizer created, and the step function is the same with or without
DiLoCo. Replica ``m``'s block of a leaf of local shape ``(d0, ...)`` is rows
``m * d0 : (m + 1) * d0`` of the global array.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

def varying_axes(x) -> frozenset:
    """Mesh axes over which ``x`` is typed as varying (empty under check_vma=False)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def manual_axes() -> tuple:
    """The mesh axes bound by the enclosing ``shard_map`` (empty outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return ()
    return tuple(getattr(mesh, "manual_axes", ()))


def check_vma_enabled(axis_name) -> bool:
    """Whether the enclosing ``shard_map`` tracks varying axes (``check_vma=True``)."""
    return axis_name in varying_axes(lax.axis_index(axis_name))


def require_axis(axis_name, who: str):
    """Raises a ``ValueError`` saying how to fix an unbound mesh axis."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    for name in names:
        try:
            lax.axis_index(name)
        except NameError:
            raise ValueError(
                f"{who}: axis_name={name!r} is not bound. Call it inside jax.shard_map over a mesh that has "
                f"an axis named {name!r}" + (" (or pass axis_name=None to compress locally)." if who.startswith("loco") else ".")
            ) from None


def to_varying(x, axes):
    """``pcast`` ``x`` to varying over ``axes`` (only those it does not already vary over)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    if not missing:
        return x
    if not check_vma_enabled(missing[0]):
        return x
    return lax.pcast(x, missing, to="varying")




def output_specs(fn, *args, mesh, in_specs):
    """``PartitionSpec`` of every output leaf of ``fn(*args)`` run inside ``shard_map`` on ``mesh``.

    Each leaf is split over the axes it is typed as varying over (in mesh
    order); invariant leaves get ``P()``. An axis goes on dim 0 (per-device
    blocks concatenated), except for a leaf laid out like an input leaf that
    ``in_specs`` splits on another dimension (an FSDP shard, :mod:`loco_jax.fsdp`):
    a leaf of a subtree with an input's structure and local shapes (AdamW's
    moments, DiLoCo's global parameters) takes that input leaf's dimension
    for each axis both vary over; any other leaf whose local shape equals an
    input shard's, or equals it after dim 0 (a slice of a scanned stack's
    layers), takes that dimension too. Two inputs of one local shape cut on
    different dimensions make the second rule ambiguous: raised. Traced
    abstractly with ``check_vma=True``: nothing is computed or allocated.
    """
    found = []
    placed = [_placed(a, s, mesh) for a, s in zip(args, in_specs)]
    refs = [_reference(p, mesh) for p in placed]
    by_shape = _dims_by_shape(refs)

    def spec(leaf, ref_dims=None):
        axes = tuple(n for n in mesh.axis_names if n in varying_axes(leaf))
        if not axes:
            return P()
        if getattr(leaf, "ndim", 0) == 0:
            raise ValueError(
                f"a scalar state leaf varies over {axes}; it cannot be split on dim 0. Keep scalars identical "
                "across devices (they are counters), or give the leaf a leading axis."
            )
        shape = tuple(leaf.shape)
        entries = [[] for _ in range(leaf.ndim)]
        for a in axes:
            if ref_dims is not None and a in ref_dims:
                dim = ref_dims[a]
            else:
                dim = by_shape.get((shape, a), by_shape.get(("sliced", shape[1:], a), 0))
                if dim == "ambiguous":
                    raise ValueError(
                        f"a state leaf of local shape {shape} varies over {a!r}, and two inputs of that shape are "
                        f"split over {a!r} on different dimensions; its layout cannot be told. Give those inputs "
                        "distinct shapes or lay the state out explicitly."
                    )
            entries[dim].append(a)
        while entries and not entries[-1]:
            entries.pop()
        return P(*[None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries])

    def body(*a):
        out = fn(*a)
        found.append(_specs_of(out, refs, spec))
        return ()

    jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=(), check_vma=True), *placed)
    return found[0]


def _local_shape(shape, spec, mesh):
    shape = list(shape)
    for i, entry in enumerate(spec):
        for name in (entry if isinstance(entry, tuple) else (entry,)):
            if name is not None:
                shape[i] //= mesh.shape[name]
    return tuple(shape)


def _reference(placed_arg, mesh):
    """(treedef, local shapes, per leaf {axis: dim}) of an abstract input."""
    leaves, treedef = jax.tree.flatten(placed_arg)
    shapes, dims = [], []
    for leaf in leaves:
        spec = leaf.sharding.spec
        shapes.append(_local_shape(leaf.shape, spec, mesh))
        dims.append({name: i for i, entry in enumerate(spec)
                     for name in (entry if isinstance(entry, tuple) else (entry,)) if name is not None})
    return treedef, tuple(shapes), dims


def _dims_by_shape(refs):
    """{(local shape, axis): dim} and {("sliced", shape[1:], axis): dim} of inputs split off dim 0."""
    table = {}
    for _, shapes, dims in refs:
        for shape, axis_dims in zip(shapes, dims):
            for axis, dim in axis_dims.items():
                keys = [(shape, axis)] + ([("sliced", shape[1:], axis)] if dim >= 1 else [])
                for key in keys:
                    if table.get(key, dim) != dim:
                        table[key] = "ambiguous"
                    else:
                        table[key] = dim
    return {k: v for k, v in table.items() if v != 0}


def _specs_of(out, refs, spec):
    """``spec`` of every leaf of ``out``; subtrees matching an input's structure and shapes use its dims."""
    matches = {(treedef, shapes): dims for treedef, shapes, dims in refs if treedef.num_leaves > 1}

    def match(node):
        leaves, treedef = jax.tree.flatten(node)
        return (treedef, tuple(tuple(getattr(x, "shape", ())) for x in leaves)) in matches if leaves else False

    def one(node):
        if match(node):
            leaves, treedef = jax.tree.flatten(node)
            dims = matches[(treedef, tuple(tuple(x.shape) for x in leaves))]
            return jax.tree.unflatten(treedef, [spec(x, d) for x, d in zip(leaves, dims)])
        return spec(node)

    if not matches:
        return jax.tree.map(spec, out)
    marked = jax.tree.map(lambda n: _Done(one(n)), out, is_leaf=match)
    return jax.tree.map(lambda d: d.value, marked, is_leaf=lambda x: isinstance(x, _Done))


class _Done:
    """A finished sub-result inside a tree map (not a pytree node)."""

    def __init__(self, value):
        self.value = value


def _placed(arg, spec_prefix, mesh):
    """Abstract copies of ``arg``'s leaves, sharded on ``mesh`` as the (prefix) specs say."""

    def place(spec, subtree):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), x.dtype, sharding=jax.NamedSharding(mesh, spec)), subtree
        )

    return jax.tree.map(place, spec_prefix, arg, is_leaf=lambda s: isinstance(s, P))
