"""Test set-up: 8 simulated CPU devices, set before jax is imported."""

import os
import random

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


WORDS = (
    "the of and to a in that is was he for it with as his on be at by this had not are but from or have an they "
    "which one you were her all she there would their we him been has when who will more no if out so said what up"
).split()


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    """A small corpus the tests write themselves: 4000 lines of words."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(4000)]
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("\n".join(lines))
    return str(path)


@pytest.fixture(scope="session")
def data_mesh():
    """A flat 8-way data-parallel mesh."""
    return jax.make_mesh((8,), ("data",))


# Test files by their cost on 2 cores (cold compilation cache; `--durations=0` summed per file, 2026-12-06; files not
# listed come after, in collection order). With `pytest -n 2 --dist loadfile --no-loadscope-reorder` the
# workers take files in this order, heaviest first, so no heavy file starts last while the other worker idles
# (xdist's own reorder puts files with the most tests first: the heavy end-to-end files, with few tests, last).
HEAVIEST_FIRST = (
    "test_trainer.py", "test_elastic.py", "test_sync_steps.py", "test_backward.py", "test_sparse.py", "test_diloco.py",
    "test_failures.py", "test_loco.py", "test_fsdp.py", "test_faults.py", "test_islands.py", "test_gpu_schedule.py",
    "test_defaults.py", "test_formats.py", "test_model.py", "test_async.py", "test_sample.py",
    "test_validation.py", "test_muon.py", "test_collectives.py", "test_quant.py", "test_properties.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept
