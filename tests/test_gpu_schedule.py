"""The GPU compiler's schedule, read from programs compiled for 8 H200s on this CPU-only machine
(benchmarks/gpu_schedule.py).

The reader is checked on a small stored program (``tests/data/gpu_h200_2x4_sample.hlo``: the scheduled
HLO of ``y = tanh(x @ w1) @ w2; psum(y, "data"); all_gather(u8(w2), "replica")`` under ``shard_map`` on
a 2 x 4 (replica, data) mesh of H200s, x of 128 x 512 rows per device, w1 and w2 of 512 x 512, bf16),
whose figures follow by hand. The recipe test compiles ``configs/tiny.py`` for GPUs in a subprocess that
sees jax's CUDA plugin, installed without its CUDA libraries into a cache folder (jax's own package
index: no GPU needed, nothing else in this environment changes).
"""

import json
import os
import subprocess
import sys

import jax
import pytest

from benchmarks import gpu_schedule, gpu_targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(ROOT, "tests", "data", "gpu_h200_2x4_sample.hlo")
GEMM = 2 * 128 * 512 * 512  # one 128 x 512 by 512 x 512 product per device


def _sample(edit=lambda text: text):
    with open(SAMPLE) as f:
        return gpu_schedule.analyze(edit(f.read()), replicas=2, devices=8)


def test_the_sample_program_reads_as_worked_out_by_hand():
    s = _sample()
    assert (s.gemms, s.gemm_flops, s.while_loops) == (2, 2 * GEMM, [])
    by_kind = {c.kind: c for c in s.collectives}
    assert sorted(by_kind) == ["all-gather", "all-reduce"]
    gather, reduce = by_kind["all-gather"], by_kind["all-reduce"]
    # the exchange over replica: u8[2,512,512] gathered, async, the second gemm scheduled under it
    assert (gather.crosses_replica, gather.dtypes, gather.bytes, gather.is_async) == (True, ("u8",), 2 * 512 * 512, True)
    assert (gather.gemms_under, gather.gemm_flops_under, s.share_under(gather)) == (1, GEMM, 0.5)
    # the psum over data: bf16[128,512], inside each replica, marked synchronous by the compiler
    assert (reduce.crosses_replica, reduce.dtypes, reduce.bytes, reduce.is_async) == (False, ("bf16",), 128 * 512 * 2,
                                                                                      False)
    assert reduce.gemms_under == 0 and not reduce.narrow_int_all_reduce
    assert all(c.count == 1 for c in s.collectives)


def test_a_narrow_integer_all_reduce_is_flagged():
    s = _sample(lambda t: t.replace("%all-reduce-done = bf16[128,512]", "%all-reduce-done = s8[128,512]"))
    assert [c.kind for c in s.collectives if c.narrow_int_all_reduce] == ["all-reduce"]


def test_groups_within_a_replica_do_not_cross_it():
    one_replica = gpu_schedule.analyze(open(SAMPLE).read(), replicas=1, devices=8)
    assert not one_replica.cross_replica()
    four = gpu_schedule.analyze(open(SAMPLE).read(), replicas=4, devices=8)  # groups {0..3}, {4..7} span 2 each
    assert {c.kind for c in four.cross_replica()} == {"all-gather", "all-reduce"}


def test_our_target_descriptions_name_the_hardware():
    h200, h100 = gpu_targets.target_config("h200"), gpu_targets.target_config("h100")
    assert "device_memory_size: 151397597184" in h200 and 'name: "NVIDIA H200 141GB HBM3e"' in h200
    assert "memory_bandwidth: 3352320000000" in h100 and "core_count: 132" in h100
    with pytest.raises(ValueError, match="gpu='a100' is not described; choose one of"):
        gpu_targets.target_config("a100")


@pytest.fixture(scope="session")
def cuda_plugin():
    """A folder holding jax's CUDA plugin (no CUDA libraries), for a subprocess's PYTHONPATH."""
    version = jax.__version__
    folder = os.path.join(os.path.expanduser("~"), ".cache", "loco_jax", f"jax_cuda12_plugin-{version}")
    if not os.path.isdir(os.path.join(folder, "jax_plugins")):
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", folder,
               f"jax-cuda12-plugin=={version}", f"jax-cuda12-pjrt=={version}"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            if os.environ.get("CI"):
                raise RuntimeError(f"could not install jax's CUDA plugin: {result.stderr[-2000:]}")
            pytest.skip(f"jax's CUDA plugin could not be installed here (no package index?): {result.stderr[-300:]}")
    return folder


def _plugin_env(cuda_plugin):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([cuda_plugin, ROOT]))
    env.pop("XLA_FLAGS", None)
    return env


SMALL_MODEL = ("model.d_model=64", "model.num_layers=2", "model.d_ff=192")


def _schedule(cuda_plugin, tmp_path, config, *sets, model=SMALL_MODEL, args=()):
    """(stdout, JSON figures) of benchmarks/gpu_schedule.py on ``configs/<config>`` with a smaller model."""
    out = tmp_path / "schedule.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_schedule.py"), "--config",
           os.path.join(ROOT, "configs", config), *[a for kv in model + sets for a in ("--set", kv)], *args,
           "--json", str(out)]
    result = subprocess.run(cmd, env=_plugin_env(cuda_plugin), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, json.loads(out.read_text())


def test_tiny_recipe_compiled_for_eight_h200s(cuda_plugin, tmp_path):
    """configs/tiny.py (a smaller model, same mesh and schedule) compiled for one host of 8 H200s, its first two
    programs (the send/apply step of fragment 0 and the quiet step; the other fragments' send steps differ only
    in sizes): the exchange crosses replica as uint8 in the send program only, and is all that crosses it;
    nothing crosses replica in the quiet program; no narrow-integer all-reduce anywhere, and the figures are the tool's JSON."""
    stdout, programs = _schedule(cuda_plugin, tmp_path, "tiny.py", args=("--first", "2"))
    assert "on 1x1x8 H200" in stdout
    assert sorted(programs) == ["Phase(send=0, apply=0)", "Phase(send=None, apply=None)"]
    quiet = programs["Phase(send=None, apply=None)"]
    for name, p in programs.items():
        # the same model step; a send program adds the small matmuls of the exchange's Hadamard rotation (each
        # device un-rotates the whole fragment it gathers as codes: 1.05 % of this small model's step)
        assert p["gemms"] > 0 and quiet["gemm_flops"] <= p["gemm_flops"] <= 1.02 * quiet["gemm_flops"], name
        assert p["memory"]["temp"] > 0 and p["memory"]["argument"] > 0
        assert not any(c["kind"] == "all-reduce" and set(c["dtypes"]) & {"s8", "u8", "s4", "u4", "s16", "u16"}
                       for c in p["collectives"]), name
        cross = [c for c in p["collectives"] if c["crosses_replica"]]
        # metrics are averaged inside each replica (the host averages replicas) and finite flags are decided
        # per replica (the exchanged mean carries a NaN to every replica): only the uint8 exchange crosses
        if name == "Phase(send=None, apply=None)":
            assert cross == [], cross
        else:
            assert len(cross) == 1 and cross[0]["kind"] == "all-gather" and cross[0]["dtypes"] == ["u8"], cross
            assert cross[0]["bytes"] > 1000


_REDUCE_BIG_LEAF = """
import jax, jax.numpy as jnp, numpy as np
from benchmarks import gpu_schedule
from loco_jax import nonfinite
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.sharding.Mesh(np.array(gpu_schedule.gpu_devices()[:1]), ("d",))
x = jax.ShapeDtypeStruct((4097, 4096), jnp.float32, sharding=NamedSharding(mesh, P()))
f = jax.jit(lambda a: nonfinite.reduce_leaf(lambda v: jnp.sum(jnp.square(v)), a))
s = gpu_schedule.analyze(f.trace(x).lower().compile().as_text(), replicas=1, devices=1)
print(len(s.while_loops))
"""


def test_big_leaf_reductions_slice_on_cpu_and_fuse_on_gpu(cuda_plugin):
    """``nonfinite.reduce_leaf`` (the finite flag, the gradient's norm) loops over dim-0 slices of a big leaf on
    CPU only, where a fused reduction would copy the leaf; compiled for a GPU it is one reduction."""
    import numpy as np
    from jax import lax

    from loco_jax import nonfinite

    x = np.random.default_rng(0).standard_normal((4097, 4096), dtype=np.float32)
    fn = lambda v: jax.numpy.sum(jax.numpy.square(v))
    f = jax.jit(lambda a: nonfinite.reduce_leaf(fn, a))
    assert f.lower(x).compile().as_text().count(" while(") == 1
    assert float(f(x)) == float(jax.jit(lambda a: fn(lax.map(fn, a)))(x))  # the CPU path as it was
    result = subprocess.run([sys.executable, "-c", _REDUCE_BIG_LEAF], env=_plugin_env(cuda_plugin), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "0"


def test_loco_buckets_are_not_chained_on_gpu(cuda_plugin, tmp_path):
    """configs/loco.py (a smaller model) with many LoCo buckets, compiled for 8 H200s: no uint8 collective is
    synchronous. On CPU each bucket waits for the previous one's decode (tests/test_fsdp.py pins the memory
    that saves); compiled for GPU that chain made communication and quantization alternate."""
    _, programs = _schedule(cuda_plugin, tmp_path, "loco.py", "loco.bucket_size=16384")
    (program,) = programs.values()
    payloads = [c for c in program["collectives"] if c["dtypes"] == ["u8"]]
    assert len(payloads) >= 2 and not [c["name"] for c in payloads if not c["is_async"]], payloads


def test_the_8b_recipe_runs_its_exchanges_under_the_step(cuda_plugin, tmp_path):
    """configs/diloco_8b.py with 4 of its 32 blocks (every shape of the recipe otherwise: FSDP, scanned
    rematerialised blocks, 8 micro-batches, loco.in_backward) on 2 hosts x 8 H200s, its send program of
    fragment 0, with the XLA options the trainer sets:

    - Streaming DiLoCo's exchange across replicas is one asynchronous uint8 all-gather, hinted onto its own
      stream, with at least 90 % of the step's gemm FLOPs between its start and its done. (With the
      trainer's earlier overlap limit of 5 the scheduler closed it before the layer loops: 7.7 %.)
    - LoCo's per-block all-to-alls inside the backward loop are asynchronous with gemms under them, and a
      large share of the micro-batch's backward gemm FLOPs runs under one of them; exchanged after the
      backward pass (a small model is enough to show it), none does."""
    sets = ("model.num_layers=4", "mesh.replicas=2", "batch_size=128", "diloco.num_fragments=3")
    _, programs = _schedule(cuda_plugin, tmp_path, "diloco_8b.py", *sets, model=(),
                            args=("--topology", "1x2x8", "--first", "1"))
    (program,) = programs.values()
    (cross,) = [c for c in program["collectives"] if c["crosses_replica"]]
    assert (cross["kind"], cross["dtypes"], cross["is_async"], cross["own_stream"]) == (
        "all-gather", ["u8"], True, True), cross
    assert cross["share_under"] >= 0.9, cross
    x = program["exchange"]
    # (the embedding's bucket comes last, with no compute left: the scheduler may run it synchronously)
    assert x["collectives"] >= 4 and x["synchronous"] <= 1, x
    looped = [c for c in program["collectives"] if c["dtypes"] == ["u8"] and c["count"] == 3]
    assert looped and all(c["is_async"] and c["gemms_under"] > 0 for c in looped), program["collectives"]
    assert x["share"] > 0.3, x
    small = ("model.num_layers=4", "mesh.fsdp=true", "model.scan_layers=true", "model.remat=true")
    _, after = _schedule(cuda_plugin, tmp_path, "loco.py", *small)
    assert next(iter(after.values()))["exchange"]["share"] == 0.0
