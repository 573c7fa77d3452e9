"""Non-finite values: one decision per step, agreed over named mesh axes.

NaN and Inf are carried, never masked: a bad block decodes to NaN and fp32 sums pass it on, so a bad
value on any device shows in some device's output. A transformation that decides from its outputs
(:func:`loco_jax.loco.compress`, :func:`skip_nonfinite`) reduces one flag

    ok = AND over the devices of ``axes`` of ( every value of the tree is finite )

with one scalar ``pmin`` over ``axes``, so every device of those axes takes the same branch. Which axes
is explicit: every mesh axis bound by the enclosing ``shard_map`` but those the caller names as
independent, passed down as the optax extra argument ``independent_axes`` (:data:`INDEPENDENT`).
:func:`loco_jax.diloco.diloco` passes its ``replica`` axis to its inner optimizer's ``update``: replicas
train alone between syncs, so each replica decides alone and nothing crosses ``replica`` for it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from loco_jax import specs

# The optax extra argument that names the mesh axes a step's decision is not agreed over.
INDEPENDENT = "independent_axes"

_CHUNKED = 2**24  # values: a leaf this big is reduced one dim-0 slice at a time


def reduce_leaf(fn, leaf):
    """``fn(leaf)`` for a scalar reduction ``fn``; on CPU over dim-0 slices for big leaves (combined by ``fn``).

    XLA:CPU materializes a reduction's elementwise input (a full fp32 or bool copy of a gradient-sized
    leaf); slice by slice only one slice is ever materialized. GPU reductions fuse their input, and there a
    loop over slices would be thousands of serial kernel launches per step: the choice is made for the
    platform the program is compiled for (``lax.platform_dependent``), not the one that traces it.
    """
    if leaf.ndim >= 2 and leaf.size > _CHUNKED and leaf.shape[0] > 1:
        return lax.platform_dependent(leaf, cpu=lambda x: fn(lax.map(fn, x)), default=fn)
    return fn(leaf)


def locally_finite(tree):
    """One boolean: every value of ``tree`` on this device is finite (no collective)."""
    flag = jnp.array(True)
    for leaf in jax.tree.leaves(tree):
        flag = flag & reduce_leaf(lambda x: jnp.all(jnp.isfinite(x)), leaf)
    return flag


def decision_axes(independent=()) -> tuple:
    """The bound mesh axes a step's decision is agreed over: all of them but ``independent``."""
    return tuple(a for a in specs.manual_axes() if a not in tuple(independent))


def all_finite(tree, axes):
    """One boolean, identical on every device of ``axes``: all of ``tree`` is finite on all of them.

    A scalar ``pmin`` over ``axes`` (none where ``axes`` is empty, outside ``shard_map`` included)."""
    flag = locally_finite(tree).astype(jnp.int32)
    if axes:
        flag = lax.pmin(specs.to_varying(flag, axes), axes)
    return flag.astype(bool)


def select(ok, new, old):
    """``new`` where ``ok``, else ``old``, leaf by leaf (a skipped step keeps the old state)."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


class SkipNonfiniteState(NamedTuple):
    inner: Any
    skipped: jax.Array  # int32 []


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Skips the whole ``inner`` step on every device when any gradient anywhere is non-finite.

    Like ``optax.apply_if_finite``, but the decision is one flag agreed over every bound mesh axis but the
    ``independent_axes`` its caller passes (:func:`all_finite`), so all of those devices skip together. On a
    skipped step the updates are zeros and ``inner``'s state is unchanged; ``skipped`` counts.
    """
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return SkipNonfiniteState(inner.init(params), jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None, **extra):
        ok = all_finite(updates, decision_axes(extra.get(INDEPENDENT, ())))
        new_updates, new_inner = inner.update(updates, state.inner, params, **extra)
        new_updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), new_updates)
        new_inner = select(ok, new_inner, state.inner)
        return new_updates, SkipNonfiniteState(new_inner, state.skipped + (~ok).astype(jnp.int32))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
