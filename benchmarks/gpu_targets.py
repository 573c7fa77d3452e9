"""GPU target descriptions for compiling without a GPU: the facts of an H100 SXM and an H200.

:func:`target_config` writes XLA's ``GpuTargetConfigProto`` in text form from the table below, which
``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)`` takes to describe
GPUs on a machine that has none (:mod:`benchmarks.gpu_schedule`). The numbers are hardware facts: SM
count and limits, memory size and bandwidth, clock rates, compute capability 9.0a, and the per-SM rates
XLA's cost model reads for each data type (scalar units and tensor cores; keys are XLA's
``PrimitiveType`` numbers: 2 s8, 4 s32, 6 u8, 8 u32, 10 f16, 11 f32, 12 f64, 16 bf16, 19-36 the fp8 and
fp4 types). The two GPUs differ only in memory (80 GB HBM3 at 3.35 TB/s against 141 GB HBM3e at 4.8 TB/s).
"""

from __future__ import annotations

GPUS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", memory=84_942_979_072, bandwidth=3_352_320_000_000,
                 memory_clock_khz=2_619_000, dnn=(8, 9, 4)),
    "h200": dict(name="NVIDIA H200 141GB HBM3e", memory=151_397_597_184, bandwidth=4_800_000_000_000,
                 memory_clock_khz=3_750_000, dnn=(9, 10, 0)),
}
CLOCK_GHZ, TENSOR_CLOCK_GHZ, SMS = 1.98, 1.8295201, 132
# type key -> (units per SM, operations per clock)
SCALAR_RATES = {4: (64, 1), 8: (64, 1), 10: (128, 2), 11: (128, 1), 12: (64, 1), 16: (128, 2)}
TENSOR_RATES = {2: (4, 1024), 6: (4, 1024), 10: (4, 512), 11: (4, 256), 12: (4, 32), 16: (4, 512),
                **{k: (4, 1024) for k in (19, 20, 23, 24, 25, 28, 29, 33, 35, 36)}}


def _rates(name, table, clock_of):
    out = [f"  {name} {{"]
    for key, (units, ops) in table.items():
        out += ["    rate_infos {", f"      key: {key}", "      value {", f"        clock_rate_ghz: {clock_of(key)}",
                f"        units_per_core: {units}", f"        ops_per_clock: {ops}", "      }", "    }"]
    return out + ["  }"]


def target_config(gpu: str = "h200") -> str:
    """The ``GpuTargetConfigProto`` text of ``gpu`` ("h100" or "h200")."""
    if gpu not in GPUS:
        raise ValueError(f"gpu={gpu!r} is not described; choose one of {sorted(GPUS)}.")
    g = GPUS[gpu]
    model = (f"sm_9.0a with {g['memory']}B RAM, {SMS} cores, {int(CLOCK_GHZ * 1e6)}KHz clock, "
             f"{g['memory_clock_khz']}KHz mem clock, 52428800B L2$")
    lines = [
        "gpu_device_info {",
        "  threads_per_block_limit: 1024", "  threads_per_warp: 32", "  shared_memory_per_block: 49152",
        "  shared_memory_per_core: 233472", "  threads_per_core_limit: 2048", f"  core_count: {SMS}",
        "  fpus_per_core: 128", "  block_dim_limit_x: 2147483647", "  block_dim_limit_y: 65535",
        "  block_dim_limit_z: 65535", f"  memory_bandwidth: {g['bandwidth']}", "  l2_cache_size: 52428800",
        f"  clock_rate_ghz: {CLOCK_GHZ}", f"  device_memory_size: {g['memory']}",
        "  shared_memory_per_block_optin: 232448",
        "  cuda_compute_capability {", "    major: 9", "    feature_extension: ACCELERATED_FEATURES", "  }",
        "  registers_per_core_limit: 65536", "  registers_per_block_limit: 65536",
        *_rates("scalar_unit_description", SCALAR_RATES, lambda k: CLOCK_GHZ),
        *_rates("matrix_unit_description", TENSOR_RATES, lambda k: CLOCK_GHZ if k == 12 else TENSOR_CLOCK_GHZ),
        "  thread_dim_limit_x: 1024", "  thread_dim_limit_y: 1024", "  thread_dim_limit_z: 64",
        '  device_vendor: "NVIDIA Corporation"', '  platform_version: "Compute Capability 9.0a"',
        f'  model_str: "{model}"', "  device_address_bits: 64", "  pcie_bandwidth: 34359738368",
        "  ecc_enabled: true", f'  name: "{g["name"]}"', '  driver_version: "13.0.0"',
        '  runtime_version: "12.8.0"', '  compile_time_toolkit_version: "12.8.0"', '  dnn_version: "9.10.0"',
        '  cub_version: "3.1.2"', "  device_interconnect_info {", "    active_links: 18", "  }",
        "}",
    ]
    major, minor, patch = g["dnn"]
    lines += ['platform_name: "CUDA"', "dnn_version_info {", f"  major: {major}", f"  minor: {minor}",
              f"  patch: {patch}", "}", f'device_description_str: "{g["name"]}"']
    return "\n".join(lines) + "\n"
