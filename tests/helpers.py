"""Small shared helpers for the multi-device tests and the ones that start ``train.py`` in a subprocess."""

import os
import socket
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def free_port():
    """A TCP port free on localhost now (for a subprocess's coordinator)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def train_cmd(config_path, workdir, *extra):
    """The command line that runs this checkout's ``train.py`` on ``config_path`` into ``workdir``."""
    return [sys.executable, os.path.join(ROOT, "train.py"), "--config", config_path, "--workdir", workdir, *extra]


def subprocess_env():
    """The environment of a ``train.py`` subprocess: CPU, this checkout on the path, the session's cache."""
    # the test session's compilation cache (conftest.py): a subprocess compiling the same programs loads them
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=str(jax.config.jax_persistent_cache_min_compile_time_secs))
    env.pop("XLA_FLAGS", None)  # each process sets its own device count
    return env
