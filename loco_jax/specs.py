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

    Each leaf is split on dim 0 over the axes it is typed as varying over (in
    mesh order); invariant leaves get ``P()``. Traced abstractly with
    ``check_vma=True``: nothing is computed or allocated.
    """
    found = []

    def spec(leaf):
        axes = tuple(n for n in mesh.axis_names if n in varying_axes(leaf))
        if not axes:
            return P()
        if getattr(leaf, "ndim", 0) == 0:
            raise ValueError(
                f"a scalar state leaf varies over {axes}; it cannot be split on dim 0. Keep scalars identical "
                "across devices (they are counters), or give the leaf a leading axis."
            )
        return P(axes[0] if len(axes) == 1 else axes)

    def body(*a):
        out = fn(*a)
        leaves, treedef = jax.tree.flatten(out)
        found.append(jax.tree.unflatten(treedef, [spec(leaf) for leaf in leaves]))
        return ()

    abstract = [_placed(a, s, mesh) for a, s in zip(args, in_specs)]
    jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=(), check_vma=True), *abstract)
    return found[0]


def _placed(arg, spec_prefix, mesh):
    """Abstract copies of ``arg``'s leaves, sharded on ``mesh`` as the (prefix) specs say."""

    def place(spec, subtree):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), x.dtype, sharding=jax.NamedSharding(mesh, spec)), subtree
        )

    return jax.tree.map(place, spec_prefix, arg, is_leaf=lambda s: isinstance(s, P))
