"""FSDP (ZeRO-3) inside a replica: the shard layout, the all-gather for the step, and global-norm clipping.

Every device of the ``data`` axis (``D`` of them) holds ``1/D`` of every
parameter, of the optimizer's moments and of DiLoCo's global parameters and
outer state. A step gathers the full parameters in the compute dtype, takes the
local gradient with respect to them, and reduce-scatters it back to shards
through ``loco.compress(reduce="scatter", shard_dims=...)`` (``uint8`` payloads
when ``bits`` is set, an exact fp32 ``psum_scatter`` otherwise).

Which dimension a leaf is cut on (:func:`shard_dims`), for a leaf of full
shape ``s`` over ``D`` devices::

    candidates = [i for i in dims(s) if s[i] % D == 0], without dim 0 of a scanned stack
    k          = the candidate with the largest s[i] (the first of equals)

A scanned stack's dim 0 is its layer axis: cutting it would put whole layers
on single devices and leave the others idle during that layer's gather, and
Streaming DiLoCo's fragments are slices of it. A leaf with no candidate is
refused by name, with its shape and the fix.

The global view of a shard-cut leaf is the full leaf, split on dim ``k`` over
``data`` (``P(None, ..., "data", ...)``); with DiLoCo the replicas' blocks are
concatenated on dim 0 as :mod:`loco_jax.specs` describes. Optimizer leaves
shaped like a parameter's shard (AdamW's moments, DiLoCo's global parameters
and, for scanned stacks, the outer state of a fragment's layer slices) take the
same layout (:func:`loco_jax.specs.output_specs` with ``like=``).

Clipping: after the reduce-scatter each device holds a different shard, so
``optax.clip_by_global_norm`` would clip each shard by its own norm. Here
``|g|^2`` is the ``psum`` over ``data`` of the shards' squared norms, one
scalar collective (:func:`clip_by_global_norm`).

Reference: ZeRO (Rajbhandari et al. 2020, stage 3); PyTorch FSDP's
FULL_SHARD; docs/algorithms.md, "5. FSDP's reduce-scatter" (the reduce-scatter stage of LoCo's
all-reduce is what FSDP keeps).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from loco_jax import collectives as coll
from loco_jax import fragments, specs
from loco_jax.checks import require_int


def _paths(tree):
    return [fragments.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def shard_dims(params, num_shards: int, *, stacked=None):
    """Per leaf of ``params`` (full shapes), the dimension its FSDP shard is cut on (module docstring).

    ``stacked``: a pytree of bools (True: a scanned stack, dim 0 is its layer axis), or None to detect
    scanned leaves from their paths as :mod:`loco_jax.fragments` does. Raises a ``ValueError`` naming
    the first leaf that has no dimension divisible by ``num_shards``.
    """
    require_int("num_shards", num_shards, "a positive integer (the devices of the data axis)")
    with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    flags = (jax.tree.leaves(stacked) if stacked is not None
             else [fragments.is_stacked(path) for path, _ in with_path])
    dims = []
    for (path, leaf), is_stacked in zip(with_path, flags):
        shape = tuple(leaf.shape)
        first = 1 if is_stacked else 0
        candidates = [i for i in range(first, len(shape)) if shape[i] % num_shards == 0]
        if not candidates:
            what = "a scalar" if not shape else (
                f"no dimension{' after its layer axis' if is_stacked else ''} divisible by {num_shards}")
            raise ValueError(
                f"FSDP over {num_shards} devices: parameter {fragments.path_str(path)!r} of shape {shape} has {what}. "
                f"Choose a shard count that divides one of its dimensions{' (not the layer axis)' if is_stacked else ''}, "
                "change the model size, or pad that dimension."
            )
        dims.append(max(candidates, key=lambda i: (shape[i], -i)))
    return jax.tree.unflatten(treedef, dims)


def full_shape(shard_shape, dim: int, parts: int) -> tuple:
    """The full shape of a leaf whose shard on ``dim`` over ``parts`` devices has ``shard_shape``."""
    return tuple(n * parts if i == dim else n for i, n in enumerate(shard_shape))


def local_shapes(params, dims, num_shards: int):
    """The shard shape of every leaf (``ShapeDtypeStruct``), for abstract traces."""
    return jax.tree.map(
        lambda x, d: jax.ShapeDtypeStruct(coll.shard_shape(tuple(x.shape), d, num_shards), x.dtype), params, dims
    )


def partition_specs(dims, axis: str = "data", *, leading: str | None = None):
    """``PartitionSpec`` of every shard-cut leaf: ``axis`` on its dimension; ``leading`` (e.g. ``"replica"``,
    whose blocks are concatenated on dim 0) on dim 0 as well."""

    def spec(dim):
        entries = [None] * (dim + 1)
        entries[dim] = axis
        if leading is not None:
            entries[0] = (leading, axis) if dim == 0 else leading
        return P(*entries)

    return jax.tree.map(spec, dims)


def gather(shards, dims, axis_name: str = "data", *, dtype=None):
    """The full parameters from this device's shards, inside ``shard_map``: one tiled ``all_gather`` per
    leaf on its shard dimension, after casting to ``dtype`` (the compute dtype: half the bytes in bf16,
    sent as ``uint16`` bit patterns so that no backend widens them).

    The result is typed invariant over ``axis_name`` (identical on every device of it). Compiled for CPU,
    each leaf's gather waits for the one before (:func:`loco_jax.collectives.after`): XLA:CPU may run
    independent collectives in different orders on different devices.
    """
    def one(x, dim):
        x = x if dtype is None else x.astype(dtype)
        if jnp.dtype(x.dtype).itemsize == 2:  # bf16 / fp16 travel as uint16: some backends widen them to fp32
            bits = lax.all_gather(lax.bitcast_convert_type(x, jnp.uint16), axis_name, axis=dim, tiled=True,
                                  to="invarying")
            return lax.bitcast_convert_type(bits, x.dtype)
        return lax.all_gather(x, axis_name, axis=dim, tiled=True, to="invarying")

    leaves, treedef = jax.tree.flatten(shards)
    full = []
    for x, dim in zip(leaves, treedef.flatten_up_to(dims)):
        full.append(one(coll.after(x, full[-1:]), dim))
    return jax.tree.unflatten(treedef, full)


def global_norm(tree, axis_name: str = "data"):
    """``sqrt(psum_axis(sum of squares))``: the norm of the whole tree whose leaves are shards over ``axis_name``."""
    local = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))
    return jnp.sqrt(lax.psum(specs.to_varying(local, (axis_name,)), axis_name))


class ClipState(NamedTuple):
    """Empty: clipping keeps no state."""


def own_shards(tree, dims, axis_name: str = "data"):
    """This device's FSDP shard of every leaf of a tree that is whole on each device of ``axis_name``:
    the ``1/D`` slice on the leaf's dimension in ``dims`` (:func:`shard_dims`), at this device's index."""
    index, count = lax.axis_index(axis_name), lax.axis_size(axis_name)

    def cut(x, dim):
        size = x.shape[dim] // count
        return lax.dynamic_slice_in_dim(x, index * size, size, axis=dim)

    return jax.tree.map(cut, tree, dims)


def clip_by_global_norm(max_norm: float, axis_name: str = "data", *, slice_dims=None) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` for shard-shaped updates: ``g`` if ``|g| < max_norm``, else
    ``g / |g| * max_norm`` (optax's formula), with ``|g|`` the norm of the whole model (:func:`global_norm`),
    identical on every device of ``axis_name``.

    ``slice_dims`` (:func:`shard_dims`): the updates are whole on every device (the replicated layout);
    each device squares only its own FSDP shard of them (:func:`own_shards`) before the ``psum``. The norm
    is then summed in the order a sharded run sums it, so the two layouts clip alike to the last bit (a
    norm one rounding apart moves every update coherently, and 50 steps of AdamW amplified that to a
    1e-4 loss gap), and each device squares ``1/D`` of the gradient instead of all of it.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be a positive number.")

    def init_fn(params):
        del params
        return ClipState()

    def update_fn(updates, state, params=None):
        del params
        norm = global_norm(updates if slice_dims is None else own_shards(updates, slice_dims, axis_name), axis_name)
        keep = norm < max_norm
        return jax.tree.map(lambda g: jnp.where(keep, g, (g / norm.astype(g.dtype)) * max_norm), updates), state

    return optax.GradientTransformation(init_fn, update_fn)
