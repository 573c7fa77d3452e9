"""Small shared helpers for the multi-device tests."""

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

DEVICES = ("replica", "data")  # every device's own slice on the (2, 4) mesh


def put(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def per_device(mesh, fn, *args, in_specs, check_vma=True):
    """Runs ``fn`` under shard_map and returns each device's output stacked on a new axis 0.

    ``fn``'s outputs may be invariant; stacking them lets a test compare devices.
    """

    def body(*a):
        return jax.tree.map(lambda o: o[None], fn(*a))

    spec = P(tuple(mesh.axis_names))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=check_vma))
    return f(*args)


def gaussian(shape, seed=0):
    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)
