"""Test set-up: 8 simulated CPU devices, set before jax is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

# A persistent compilation cache keeps reruns (and subprocesses) fast.
_CACHE = os.environ.get("LOCO_JAX_TEST_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "loco_jax_xla"))
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@pytest.fixture(scope="session")
def mesh():
    """The (replica, data) = (2, 4) mesh every multi-device test runs on."""
    assert jax.device_count() == 8, "tests need 8 simulated CPU devices"
    return jax.make_mesh((2, 4), ("replica", "data"))


@pytest.fixture(scope="session")
def data_mesh():
    """A flat 8-way data-parallel mesh."""
    return jax.make_mesh((8,), ("data",))
