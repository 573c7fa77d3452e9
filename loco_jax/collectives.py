"""Quantized all-reduce for ``jax.shard_map``: payloads cross the network as ``uint8``.

A psum of quantized integers saves nothing (XLA widens it) and overflows, so
the bandwidth-saving all-reduce is built from all-to-all and all-gather of
packed ``uint8`` payloads (ZeRO++ qgZ, LoCo's DeepSpeed code, torchft):

Two-stage form (default, ``mode="two_stage"``), M devices on ``axis_name``:

1. Flatten the pytree into one fp32 bucket, pad it to a multiple of
   ``M * block_size`` and view it as ``(M, chunk)``.
2. Quantize and pack every row; ``all_to_all``: device j receives every
   device's row j.
3. Unpack, dequantize and sum in fp32: device j owns chunk j of the sum.
   This is the reduce-scatter (:func:`quantized_psum_scatter` stops here).
4. Re-quantize the reduced chunk, ``all_gather(..., to="invarying")``,
   unpack, dequantize, un-pad, unflatten.

   Wire bytes per device: ``2 (M-1)/M * N * (b + 32/block_size) / 8``
   against ``2 (M-1)/M * 4 N`` for an fp32 ring all-reduce.

All-gather form (``mode="all_gather"``): every device quantizes its bucket
once, all-gathers all M payloads and sums them in fp32 locally:
``(M-1) * N * (b + 32/block_size) / 8`` bytes per device. Equal to two-stage
at M = 2 and more above, but one quantization instead of two; Streaming
DiLoCo's outer exchange uses it.

Hierarchical form (``fast_axis=...``): an exact ``psum_scatter`` over the fast
axis, the quantized all-reduce over ``axis_name`` on that 1/D shard, then an
``all_gather`` over the fast axis. The slow links carry 1/D of the bucket per
device, never the D-fold sum.

Every device decodes the same bytes in the same order, so all devices get a
bit-identical result (typed invariant over the reduced axes, like ``psum``).
A block holding NaN or Inf is carried as a NaN scale and decodes to NaN, so
non-finite inputs surface in the result as they would in an exact sum.

Reference: docs/algorithms.md, "3. Quantized collectives under `shard_map`".
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from loco_jax import quant
from loco_jax.specs import require_axis, varying_axes

Mode = Literal["two_stage", "all_gather"]
MODES = get_args(Mode)


def axis_size(axis_name) -> int:
    return lax.axis_size(axis_name) if axis_name is not None else 1


# --------------------------------------------------------------------------
# Buckets: a pytree as one (rows, cols) fp32 array, cols a multiple of block_size


class Bucket(NamedTuple):
    """How leaves were laid out in a ``(rows, cols)`` bucket.

    ``scatter=False``: leaves are flattened and concatenated into one vector,
    padded, and viewed as ``(rows, cols)`` (row j is chunk j of the vector).
    ``scatter=True``: each leaf is split on its shard dimension ``dims[i]``
    (default 0) and viewed as ``(rows, size / rows)`` with row j the leaf's
    j-th shard on that dimension (``moveaxis(leaf, dims[i], 0)`` flattened);
    the views are concatenated along axis 1, so every row holds exactly one
    device's shard of every leaf.
    """

    rows: int
    cols: int
    sizes: tuple
    shapes: tuple
    dtypes: tuple
    treedef: Any
    scatter: bool
    dims: tuple = ()  # scatter=True: the dimension each leaf is sharded on


def after(tree, previous):
    """``tree``, made to depend on every leaf of ``previous`` when compiled for CPU (a real data dependence).

    XLA:CPU may run two collectives of one program that nothing orders in different orders on different
    devices, and ``lax.optimization_barrier`` does not order them (XLA expands the barrier away before it
    schedules). So on CPU one element of each leaf of ``previous`` is taken as float32, times zero, converted
    to int32, and ``tree``'s first leaf becomes ``where(sum_i int32(float32(p_i[0]) * 0) == 0, x, 0)``. XLA
    converts NaN and Inf to integers saturating, NaN to 0, so the sum is exactly 0 for any ``previous``,
    finite or not, and the select returns ``x`` to the bit (arithmetic would not: XLA:CPU flushes subnormals,
    and ``-0.0 + 0`` is ``+0.0``). The simplifier cannot remove a float product with zero (``0 * NaN`` is
    NaN), while it does remove an integer one, hence the float. Compiled for another platform ``tree`` is
    returned as it is (``lax.platform_dependent``): there independent collectives are what lets
    communication overlap compute, and a GPU program issues its collectives in its one schedule's order.

    Under ``check_vma`` a leaf of ``previous`` typed varying over an axis that ``tree``'s first leaf is
    invariant over cannot order it (the sum would change that leaf's type): where each such axis has size 1
    (data parallel's batch varies over a ``replica`` axis of one device that its parameters do not) its
    element is summed over them first (``psum`` over one device: no other device takes part); otherwise
    the leaf is left out. The project's tests read every step program's compiled HLO for collectives left
    unordered (:func:`loco_jax.hlo.unordered_collectives`).
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    axes = varying_axes(leaves[0])
    prev, lone = [], {}  # lone: position in prev -> the axes of one device its head is summed over
    for p in jax.tree.leaves(previous):
        extra = varying_axes(p) - axes
        if extra and any(axis_size(a) != 1 for a in extra):
            continue
        if extra:
            lone[len(prev)] = tuple(sorted(extra))
        prev.append(p)
    if not prev:
        return tree

    def chained(first, *prev):
        heads = [p.reshape(-1)[0].astype(jnp.float32) for p in prev]
        heads = [lax.psum(h, lone[i]) if i in lone else h for i, h in enumerate(heads)]
        zero = sum((h * 0).astype(jnp.int32) for h in heads)
        return jnp.where(zero == 0, first, jnp.zeros_like(first))

    first = lax.platform_dependent(leaves[0], *prev, cpu=chained, default=lambda first, *_: first)
    return jax.tree.unflatten(treedef, [first] + leaves[1:])


def round_up(n, multiple):
    return -(-n // multiple) * multiple


def group_leaves(sizes, bucket_size):
    """Consecutive leaves in buckets of at most ``bucket_size`` values (a bigger leaf is alone)."""
    if bucket_size is None:
        return [list(range(len(sizes)))] if sizes else []
    groups, current, used = [], [], 0
    for i, size in enumerate(sizes):
        if current and used + size > bucket_size:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    if current:
        groups.append(current)
    return groups


def bucket_cols(sizes, rows, block_size, *, scatter=False, pad_multiple=1) -> int:
    """Columns of the ``(rows, cols)`` bucket that holds leaves of these sizes."""
    unit = block_size * pad_multiple
    used = sum(sizes) // rows if scatter else -(-sum(sizes) // rows)
    return max(round_up(used, unit), unit)


def make_bucket(leaves_or_tree, rows, block_size, *, scatter=False, pad_multiple=1, dims=None):
    """Lays a pytree out as an fp32 ``(rows, cols)`` array; returns ``(array, Bucket)``.

    ``cols`` is padded to a multiple of ``block_size * pad_multiple``. With
    ``scatter=True``, ``dims`` (one int per leaf, default all 0) names the
    dimension each leaf is sharded on; it must be a multiple of ``rows``.
    """
    leaves, treedef = jax.tree.flatten(leaves_or_tree)
    for leaf in leaves:
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise ValueError(
                f"quantized communication needs floating-point values, got a leaf of dtype {leaf.dtype} "
                f"and shape {leaf.shape}; cast it or keep it out of the tree."
            )
    shapes = tuple(leaf.shape for leaf in leaves)
    sizes = tuple(int(math.prod(s)) for s in shapes)
    dtypes = tuple(leaf.dtype for leaf in leaves)
    dims = tuple(dims) if dims is not None else (0,) * len(leaves) if scatter else ()
    if scatter:
        for leaf, dim in zip(leaves, dims):
            if not 0 <= dim < max(leaf.ndim, 1) or leaf.ndim == 0 or leaf.shape[dim] % rows:
                raise ValueError(
                    f"reduce='scatter' shards a leaf of shape {leaf.shape} on dim {dim} over {rows} devices; "
                    f"that dimension must exist and be a multiple of {rows} (shard another dimension, or pad it)."
                )
    cols = bucket_cols(sizes, rows, block_size, scatter=scatter, pad_multiple=pad_multiple)
    if scatter:
        parts = [jnp.moveaxis(leaf.astype(jnp.float32), dim, 0).reshape(rows, -1) for leaf, dim in zip(leaves, dims)]
        used = sum(sizes) // rows
        array = jnp.concatenate(parts + [jnp.zeros((rows, cols - used), jnp.float32)], axis=1)
    else:
        flat = jnp.concatenate([leaf.astype(jnp.float32).reshape(-1) for leaf in leaves]) if leaves else jnp.zeros((0,))
        flat = jnp.pad(flat, (0, rows * cols - flat.shape[0]))
        array = flat.reshape(rows, cols)
    return array, Bucket(rows, cols, sizes, shapes, dtypes, treedef, scatter, dims)


def unbucket(array, bucket: Bucket):
    """Full-shape pytree back from a ``(rows, cols)`` array (``scatter=False`` layout)."""
    flat = array.reshape(-1)
    leaves, start = [], 0
    for size, shape, dtype in zip(bucket.sizes, bucket.shapes, bucket.dtypes):
        leaves.append(flat[start : start + size].reshape(shape).astype(dtype))
        start += size
    return jax.tree.unflatten(bucket.treedef, leaves)


def shard_shape(shape, dim, parts):
    """The shape of one of ``parts`` equal shards of ``shape`` split on ``dim``."""
    return tuple(n // parts if i == dim else n for i, n in enumerate(shape))


def unbucket_shard(row, bucket: Bucket, dtype=None):
    """One device's shard of every leaf (on its ``bucket.dims`` dimension) from its row (``scatter=True``).

    ``dtype``: the shards' dtype (default each leaf's own).
    """
    leaves, start = [], 0
    dims = bucket.dims or (0,) * len(bucket.shapes)
    for size, shape, leaf_dtype, dim in zip(bucket.sizes, bucket.shapes, bucket.dtypes, dims):
        n = size // bucket.rows
        local = shard_shape(shape, dim, bucket.rows)
        moved = (local[dim],) + local[:dim] + local[dim + 1:]
        piece = jnp.moveaxis(row[start : start + n].reshape(moved), 0, dim)
        leaves.append(piece.astype(leaf_dtype if dtype is None else dtype))
        start += n
    return jax.tree.unflatten(bucket.treedef, leaves)


# --------------------------------------------------------------------------
# The quantized exchanges on a bucket


class QuantConfig(NamedTuple):
    """Payload format; ``rotate``: the exchange runs in the randomized-Hadamard domain of ``seed``."""

    bits: int = 4
    block_size: int = quant.DEFAULT_BLOCK_SIZE
    format: quant.Format = "int"
    rotate: bool = False
    seed: int = 0

    def encode(self, x, key=None):
        return quant.encode(x, self.bits, block_size=self.block_size, format=self.format, key=key)

    def decode(self, payload, cols):
        return quant.decode(payload, self.bits, cols=cols, block_size=self.block_size, format=self.format)

    def rotation_seed(self, salt):
        """One rotation per bucket (or fragment): the seed folded with ``salt``, the same on every device.

        ``salt`` may be traced (the layers of a scanned stack): the same value then, in uint32 arithmetic."""
        if isinstance(salt, (int, np.integer)):
            return (self.seed * 1_000_003 + 7919 * (salt + 1)) % 2**32
        offset = jnp.uint32(self.seed * 1_000_003 % 2**32)
        return offset + jnp.uint32(7919) * (jnp.asarray(salt).astype(jnp.uint32) + jnp.uint32(1))

    def rotate_in(self, rows, salt=0):
        """Into the rotated domain (identity when ``rotate`` is off). Rows are whole blocks."""
        return quant.rotate(rows, self.block_size, self.rotation_seed(salt)) if self.rotate else rows

    def rotate_out(self, rows, salt=0):
        return quant.unrotate(rows, self.block_size, self.rotation_seed(salt)) if self.rotate else rows


def device_key(key, axis_names, salt):
    """A key of its own for this device and stage, or None (round to nearest)."""
    if key is None:
        return None
    key = jax.random.fold_in(key, salt)
    for name in axis_names:
        key = jax.random.fold_in(key, lax.axis_index(name))
    return key


OWN_STREAM = {"_xla_gpu_collective_stream": "p2p"}  # XLA:GPU's frontend attribute for its p2p collective stream


def on_own_stream(collective, own_stream: bool = True):
    """``collective()`` traced inside ``set_xla_metadata(OWN_STREAM)`` when ``own_stream``.

    XLA:GPU takes the attribute as a hint to issue the collective on its dedicated p2p stream, and its
    latency-hiding scheduler counts it against that stream's slot instead of the one every other
    collective shares. Streaming DiLoCo's exchange across replicas (a slow link) asks for it, so that the
    collectives inside a replica (FSDP's per-layer gathers, LoCo's all-to-alls) need not queue behind it.
    Other backends ignore the attribute.
    """
    if not own_stream:
        return collective()
    from jax.experimental.xla_metadata import set_xla_metadata

    with set_xla_metadata(**OWN_STREAM):
        return collective()


def reduce_scatter_rows(rows_f32, axis_name, cfg: QuantConfig, key=None, own_stream: bool = False):
    """Stage 1: all-to-all of quantized rows, fp32 sum of the chunk this device owns.

    Returns ``(chunk_sum, sent)``: ``chunk_sum`` (cols,) is the sum over devices
    of row ``axis_index``; ``sent`` (rows, cols) is what this device's payload
    decodes to (``DQ(Q(rows_f32))``), for error feedback. ``own_stream``: see :func:`on_own_stream`.
    """
    cols = rows_f32.shape[1]
    payload = cfg.encode(rows_f32, key)
    received = payload if axis_name is None else on_own_stream(
        lambda: lax.all_to_all(payload, axis_name, 0, 0, tiled=True), own_stream)
    return cfg.decode(received, cols).sum(axis=0), cfg.decode(payload, cols)


def _gather(payload, axis_name, own_stream: bool):
    if axis_name is None:
        return payload
    return on_own_stream(lambda: lax.all_gather(payload, axis_name, axis=0, tiled=True, to="invarying"), own_stream)


def all_gather_chunk(chunk_f32, axis_name, cfg: QuantConfig, key=None, own_stream: bool = False,
                     with_payloads: bool = False):
    """Stage 2: quantize this device's chunk and all-gather every device's chunk.

    Returns ``(full, sent)``: ``full`` (M, cols) identical on every device,
    ``sent`` (cols,) what this device's chunk decodes to; ``with_payloads`` appends the gathered
    ``uint8`` payloads ``full`` was decoded from. ``own_stream``: see :func:`on_own_stream`.
    """
    cols = chunk_f32.shape[0]
    payload = cfg.encode(chunk_f32[None], key)
    gathered = _gather(payload, axis_name, own_stream)
    out = cfg.decode(gathered, cols), cfg.decode(payload, cols)[0]
    return out + (gathered,) if with_payloads else out


def all_gather_sum(rows_f32, axis_name, cfg: QuantConfig, key=None, own_stream: bool = False,
                   with_payloads: bool = False):
    """All-gather form: quantize once, gather all payloads, sum in fp32 locally.

    Returns ``(total, sent)``, both of ``rows_f32``'s shape; ``with_payloads`` appends the gathered
    ``uint8`` payloads (M, bytes) ``total`` was decoded from. ``own_stream``: see :func:`on_own_stream`.
    """
    rows, cols = rows_f32.shape
    flat = rows_f32.reshape(1, rows * cols)
    payload = cfg.encode(flat, key)
    gathered = _gather(payload, axis_name, own_stream)
    total = cfg.decode(gathered, rows * cols).sum(axis=0)
    out = total.reshape(rows, cols), cfg.decode(payload, rows * cols).reshape(rows, cols)
    return out + (gathered,) if with_payloads else out


def _validate(bits, block_size, format, mode, rotate=False, key=None):
    quant.validate(bits, block_size, format, rotate=rotate, stochastic=key is not None)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown; choose one of {MODES}.")


def _psum_rows(rows_f32, axis_name, cfg, mode, key, salt=0):
    """Quantized all-reduce of an ``(M, cols)`` bucket over ``axis_name``; fp32 (M, cols).

    With ``cfg.rotate`` each device rotates its bucket once, the sums run on
    rotated values (the rotation is linear and the same everywhere), and the
    gathered sum is rotated back once: ``R^T sum_i DQ(Q(R x_i))``.
    """
    rows_f32 = cfg.rotate_in(rows_f32, salt)
    if mode == "all_gather":
        full = all_gather_sum(rows_f32, axis_name, cfg, device_key(key, (axis_name,), 0))[0]
    else:
        chunk, _ = reduce_scatter_rows(rows_f32, axis_name, cfg, device_key(key, (axis_name,), 0))
        full, _ = all_gather_chunk(chunk, axis_name, cfg, device_key(key, (axis_name,), 1))
    return cfg.rotate_out(full, salt)


def quantized_psum(
    x,
    axis_name,
    *,
    bits: int = 4,
    block_size: int = quant.DEFAULT_BLOCK_SIZE,
    format: quant.Format = "int",
    rotate: bool = False,
    seed: int = 0,
    fast_axis=None,
    mode: Mode = "two_stage",
    key=None,
    bucket_size: int | None = None,
    _salt: int = 0,
):
    """Sum of ``x`` (an array or pytree) over ``axis_name``, sent as ``bits``-bit payloads.

    Call inside ``jax.shard_map``. Returns ``x``'s structure, shapes and
    dtypes; identical on every device. ``fast_axis``: also sum over that axis,
    exactly, with only a 1/D shard crossing ``axis_name`` (hierarchical form).
    ``mode``: ``"two_stage"`` (all-to-all + all-gather, two quantizations) or
    ``"all_gather"`` (one quantization, ``M``-fold gather). ``format``: any of
    :data:`quant.FORMATS`. ``rotate``: quantize in a randomized-Hadamard domain
    (``seed``, one rotation per bucket; needs a power-of-two block): rotate
    once, sum rotated values, rotate back once, with the same bytes on the
    wire. ``key``: stochastic rounding, folded with each device's index. ``bucket_size``: at most this
    many values per bucket (whole leaves; ``None``: the whole tree in one
    bucket, so one set of collectives however many leaves).
    """
    _validate(bits, block_size, format, mode, rotate, key)
    require_axis(axis_name, "quantized_psum")
    leaves, treedef = jax.tree.flatten(x)
    groups = group_leaves([int(math.prod(leaf.shape)) for leaf in leaves], bucket_size)
    if len(groups) > 1:
        out = [None] * len(leaves)
        for b, group in enumerate(groups):
            sub_key = None if key is None else jax.random.fold_in(key, 1000 + b)
            summed = quantized_psum([leaves[i] for i in group], axis_name, bits=bits, block_size=block_size,
                                    format=format, rotate=rotate, seed=seed, fast_axis=fast_axis, mode=mode,
                                    key=sub_key, _salt=b)
            for i, leaf in zip(group, summed):
                out[i] = leaf
        return jax.tree.unflatten(treedef, out)
    cfg = QuantConfig(bits, block_size, format, rotate, seed)
    m = axis_size(axis_name)
    if fast_axis is None:
        rows, bucket = make_bucket(x, m, block_size)
        return unbucket(_psum_rows(rows, axis_name, cfg, mode, key, _salt), bucket)
    require_axis(fast_axis, "quantized_psum")
    rows, bucket = fast_shard(x, fast_axis, m, block_size)
    key = None if key is None else device_key(key, (fast_axis,), 2)
    reduced = _psum_rows(rows, axis_name, cfg, mode, key, _salt)
    return unbucket(fast_gather(reduced, fast_axis), bucket)


def fast_shard(leaves, fast_axis, m, block_size, *, mean=False):
    """The first half of the hierarchical form: this device's ``1/D`` shard of the bucket of ``leaves``,
    summed exactly (fp32 ``psum_scatter``) over the ``D`` devices of ``fast_axis``, as ``(m, c)`` rows for
    the quantized exchange over the slow axis (``mean``: divided by ``D``). Returns ``(rows, bucket)``.

    Never a psum over the fast axis first: that would send ``D`` times the data over the slow links."""
    d = axis_size(fast_axis)
    rows, bucket = make_bucket(leaves, d, block_size, pad_multiple=m)  # (D, M * c): row i is fast device i's
    shard = lax.psum_scatter(rows, fast_axis, scatter_dimension=0, tiled=True)[0]  # exact, (M * c,)
    return (shard / d if mean else shard).reshape(m, -1), bucket


def fast_gather(rows, fast_axis):
    """The second half: every fast device's reduced shard (``rows``, ``(m, c)``) back into the whole bucket,
    ``(D, m * c)`` (an fp32 ``all_gather`` over ``fast_axis``), for :func:`unbucket`."""
    return lax.all_gather(rows.reshape(1, -1), fast_axis, axis=0, tiled=True, to="invarying")


def quantized_pmean(x, axis_name, *, fast_axis=None, **kwargs):
    """:func:`quantized_psum` divided by the number of devices summed over."""
    total = quantized_psum(x, axis_name, fast_axis=fast_axis, **kwargs)
    n = axis_size(axis_name) * (axis_size(fast_axis) if fast_axis is not None else 1)
    return jax.tree.map(lambda t: (t.astype(jnp.float32) / n).astype(t.dtype), total)


def quantized_psum_scatter(
    x,
    axis_name,
    *,
    bits: int = 4,
    block_size: int = quant.DEFAULT_BLOCK_SIZE,
    format: quant.Format = "int",
    rotate: bool = False,
    seed: int = 0,
    key=None,
):
    """Each device keeps its dim-0 chunk of the sum, like ``lax.psum_scatter(x, axis_name, tiled=True)``.

    Works on a pytree: every leaf's dim 0 must be a multiple of the axis
    size; device j gets rows ``[j * n0 / M, (j + 1) * n0 / M)`` of each leaf's
    sum. One all-to-all of ``uint8`` payloads; the sum is fp32. ``rotate``:
    as in :func:`quantized_psum` (the owned chunk is rotated back alone).
    """
    quant.validate(bits, block_size, format, rotate=rotate, stochastic=key is not None)
    require_axis(axis_name, "quantized_psum_scatter")
    cfg = QuantConfig(bits, block_size, format, rotate, seed)
    rows, bucket = make_bucket(x, axis_size(axis_name), block_size, scatter=True)
    chunk, _ = reduce_scatter_rows(cfg.rotate_in(rows), axis_name, cfg, device_key(key, (axis_name,), 0))
    return unbucket_shard(cfg.rotate_out(chunk[None])[0], bucket)


def wire_bytes_per_device(n, axis_size, *, bits=None, block_size=quant.DEFAULT_BLOCK_SIZE, mode="two_stage"):
    """Bytes per device that the ring formulas predict for ``n`` values (for docs and checks).

    ``bits=None`` is an fp32 ring all-reduce. Padding is included as the
    collectives lay it out.
    """
    m = axis_size
    if bits is None:
        return 2 * (m - 1) / m * n * 4
    cols = max(round_up(-(-n // m), block_size), block_size)
    if mode == "all_gather":
        return (m - 1) * quant.payload_bytes(m * cols, bits, block_size)
    row = quant.payload_bytes(cols, bits, block_size)
    return 2 * (m - 1) * row

