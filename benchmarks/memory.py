"""Per-device memory of a recipe's step programs, from the compiler, beside the analytic count.

    python benchmarks/memory.py --config configs/diloco_8b.py [--json] [--devices 8] [--no-write]
    PYTHONPATH=<jax CUDA plugin>:. python benchmarks/memory.py --config configs/diloco_1b.py --compiler gpu

Builds one replica of the recipe on ``--devices`` simulated CPU devices (``mesh.replicas=1``; DiLoCo's
state is kept, with one replica), with the recipe's sequences per device, and compiles its step
programs from abstract shapes: nothing is allocated. For replicated state and for FSDP
(``mesh.fsdp``) it prints, per device, from ``compiled.memory_analysis()``:

- state: the program's arguments less the batch (parameters, optimizer state; donated, so the outputs
  reuse them), beside the analytic count of the same state;
- temporaries: the compiler's buffers for the step (gathered parameters, gradients, activations,
  LoCo's working copies), and the peak: state + temporaries + outputs that do not alias an argument.

Analytic state per device, with ``P`` parameters and ``D`` devices holding shards (1 when replicated):
``4P/D`` parameters + ``8P/D`` AdamW moments + ``4P/D`` DiLoCo global parameters + ``4P/D`` outer
momentum + LoCo's error buffer, which is never sharded: ``P (error_bits / 8 + 4 / block_size)`` bytes
(its codes and block scales, padded to whole blocks per device row).

``--compiler local`` (default) compiles for this process's devices; on simulated CPU devices it is the CPU
compiler's estimate: fusion, the widening of bf16 arithmetic and
the attention kernel differ on a GPU. ``--compiler gpu`` compiles the same programs for H200s of one host
(compile-only devices from jax's CUDA plugin, no GPU needed; the plugin must be importable, as for
``benchmarks/gpu_schedule.py``): the GPU compiler's own buffer plan, the figure the README quotes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/


# Simulate exactly --devices CPU devices (the trainer's mesh takes every visible device); read before jax is imported.
_pre = argparse.ArgumentParser(add_help=False)
_pre.add_argument("--devices", type=int, default=8)
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    _count = f"--xla_force_host_platform_device_count={_pre.parse_known_args()[0].devices}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_count}".strip()

from benchmarks import common  # noqa: E402  (sets XLA_FLAGS before jax is imported)

import jax  # noqa: E402

from loco_jax import collectives  # noqa: E402
from loco_jax.training.run import config as config_lib  # noqa: E402
from loco_jax.training import model as model_lib  # noqa: E402
from loco_jax.training.run.trainer import Trainer  # noqa: E402

GIB = 2**30


def recipe(path, devices, fsdp, overrides=()):
    """The config of one replica of the recipe on ``devices`` devices, with its sequences per device."""
    cfg = config_lib.load(path, list(overrides))
    replicas = cfg.mesh.replicas
    per_device = cfg.batch_size // (replicas * devices)
    if per_device < 1 or cfg.batch_size % (replicas * devices):
        raise ValueError(f"batch_size={cfg.batch_size} over {replicas} replicas of {devices} devices is not a whole "
                         "number of sequences per device; pass --devices (the devices of one replica).")
    cfg = config_lib.override(cfg, ["mesh.replicas=1", f"mesh.data={devices}", f"mesh.fsdp={fsdp}",
                                    f"batch_size={per_device * devices}"])
    return cfg, per_device


def analytic_state(cfg, n_params, devices):
    """Bytes per device of the train state (module docstring), by part."""
    shards = devices if cfg.mesh.fsdp else 1
    parts = {"parameters": 4 * n_params / shards, "AdamW moments": 8 * n_params / shards}
    d = cfg.diloco
    if d.enabled:
        parts["DiLoCo global parameters"] = 4 * n_params / shards
        if d.outer_momentum:
            parts["outer momentum"] = 4 * n_params / shards
    c = cfg.loco
    if c.bits is not None and c.compensate:
        cols = collectives.bucket_cols([n_params], devices, c.block_size, scatter=cfg.mesh.fsdp)
        values = devices * cols  # (rows, cols): the whole gradient, padded to whole blocks per row
        per_value = (c.error_bits or 32) / 8 + (4 / c.block_size if c.error_bits else 0)
        parts["LoCo error buffer (full size)"] = values * per_value
    return parts


def phases_to_compile(trainer, quiet_only=False):
    """A quiet step, and the exchange steps of fragment 0 (embeddings and head) and fragment 1."""
    chosen = []
    for ph in trainer.tx.phases():
        if ph.send is None and ph.apply is None and "quiet" not in [c[0] for c in chosen]:
            chosen.append(("quiet", ph))
        elif ph.send in (0, 1) and ph.apply == ph.send and f"exchange {ph.send}" not in [c[0] for c in chosen]:
            chosen.append((f"exchange {ph.send}", ph))
    return chosen[:1] if quiet_only else chosen


def compile_devices(compiler, devices):
    """The devices the programs are compiled for: this process's CPU devices, or compile-only H200s of one
    host of 8 (jax's CUDA plugin, no GPU needed; benchmarks/gpu_schedule.py)."""
    if compiler == "local":
        return None  # the trainer takes every visible device
    from benchmarks import gpu_schedule

    if devices > 8:
        raise SystemExit(f"--devices {devices}: the GPU compiler's figure is for one host of 8 H200s; use 8 or fewer.")
    return gpu_schedule.gpu_devices("1x1x8", "h200")[:devices]


def measure(path, devices, fsdp, overrides=(), quiet_only=False, compiler="local"):
    if compiler == "gpu":
        from benchmarks import gpu_schedule

        overrides = list(gpu_schedule.DEVICELESS) + list(overrides)
    cfg, per_device = recipe(path, devices, fsdp, overrides)
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(cfg, workdir, log=lambda *a: None, devices=compile_devices(compiler, devices))
        state, batch = trainer.abstract_state(), trainer.abstract_batch()
        n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(model_lib.abstract_params(trainer.mcfg)))
        batch_bytes = 2 * per_device * cfg.seq_len * 4
        rows = []
        for name, phase in (phases_to_compile(trainer, quiet_only) if cfg.diloco.enabled else [("step", None)]):
            compiled = trainer.program(phase, state, batch)
            mem = compiled.memory_analysis()
            args, out, alias, temp = (mem.argument_size_in_bytes, mem.output_size_in_bytes,
                                      mem.alias_size_in_bytes, mem.temp_size_in_bytes)
            rows.append({"program": name, "state": args - batch_bytes, "temporaries": temp,
                         "peak": args + temp + max(out - alias, 0)})
        parts = analytic_state(trainer.cfg, n_params, devices)  # resolved: None settings made concrete
    return {"layout": "fsdp" if fsdp else "replicated", "devices": devices, "parameters": n_params,
            "compiler": compiler if compiler == "gpu" else jax.devices()[0].platform, "sequences_per_device": per_device, "accum_steps": trainer.accum_steps,
            "programs": rows,
            "analytic": parts, "analytic_state": sum(parts.values())}


def table(path, results):
    unit, size = ("GiB", GIB) if results[0]["analytic_state"] > GIB else ("MiB", 2**20)
    gib = lambda b: f"{b / size:,.2f}"
    where = {"cpu": "simulated CPU devices", "gpu": "H200s (the GPU compiler, deviceless: jax's CUDA plugin)"}.get(
        results[0]["compiler"], f"{results[0]['compiler']} devices")
    lines = [f"Recipe `{path}`, one replica on {results[0]['devices']} {where}, "
             f"{results[0]['parameters']:,} parameters, {results[0]['sequences_per_device']} sequences per device "
             f"per step in {results[0]['accum_steps']} micro-batch(es). {unit} per device.", "",
             "| layout | program | state (compiler) | state (analytic) | temporaries | peak |",
             "|---|---|---:|---:|---:|---:|"]
    for r in results:
        for row in r["programs"]:
            lines.append(f"| {r['layout']} | {row['program']} | {gib(row['state'])} | {gib(r['analytic_state'])} | "
                         f"{gib(row['temporaries'])} | {gib(row['peak'])} |")
    lines += ["", f"Analytic state by part ({unit} per device):", "",
              "| part | " + " | ".join(r["layout"] for r in results) + " |", "|---|" + "---:|" * len(results)]
    for part in results[0]["analytic"]:
        lines.append(f"| {part} | " + " | ".join(gib(r["analytic"].get(part, 0.0)) for r in results) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--devices", type=int, default=8, help="devices of one replica (simulated)")
    parser.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    parser.add_argument("--layout", choices=("both", "replicated", "fsdp"), default="both")
    parser.add_argument("--quiet-only", action="store_true", help="compile only the quiet step (no exchange)")
    parser.add_argument("--compiler", choices=("local", "gpu"), default="local",
                        help="local: this process's devices (simulated CPUs, or a GPU where there is one); gpu: XLA's "
                             "GPU compiler for H200s without a GPU (jax's CUDA plugin importable: see "
                             "benchmarks/gpu_schedule.py)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/results.md")
    args = parser.parse_args(argv)
    if args.compiler == "local" and jax.device_count() < args.devices:
        sys.exit(f"--devices {args.devices} needs that many devices; this process has {jax.device_count()}.")
    started = common.start()
    layouts = {"both": (False, True), "replicated": (False,), "fsdp": (True,)}[args.layout]
    results = [measure(args.config, args.devices, fsdp, args.set, args.quiet_only, args.compiler) for fsdp in layouts]
    if args.json:
        print(json.dumps(results, indent=2))
        return results
    text = table(args.config, results)
    common.report(f"## Memory per device: `{args.config}` (benchmarks/memory.py)", text, no_write=args.no_write,
                  extra_args=sys.argv[1:], started=started)
    return results


if __name__ == "__main__":
    main()
