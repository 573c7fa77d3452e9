"""Every shipped config: parameter count, bytes per step (compiled HLO), and tokens/s side by side.

    python benchmarks/configs.py                 # both parts, writes docs/results.md
    python benchmarks/configs.py --part bytes    # parameter counts and bytes only
    python benchmarks/configs.py --part speed --rounds 5 --steps-per-round 10

Bytes: each config's step programs (one per DiLoCo phase) are compiled from
abstract shapes (nothing allocated) and read with ``hlo.collective_bytes``;
averaged over one period of H steps. ``diloco_1b`` is compiled with
``scan_layers=True`` and one sequence per device (the bytes depend on the
parameters, not on the batch or on scanning).

Speed: the tiny-sized ``ddp`` (fp32 all-reduce), ``loco`` (4-bit) and
``streaming_diloco`` configs are built side by side in one process and timed
in interleaved rounds of steps (each step blocks until done), so the ratios
share the machine's noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/
from benchmarks import common  # noqa: E402  (sets XLA_FLAGS before jax is imported)

import jax  # noqa: E402

from loco_jax.training.run import config as config_lib  # noqa: E402
from loco_jax.training import model as model_lib  # noqa: E402
from loco_jax.training.run.steps import TrainState  # noqa: E402
from loco_jax.training.run.trainer import Trainer  # noqa: E402

HEADING = "## Configs: parameters, bytes per step and tokens/s (benchmarks/configs.py)"
CONFIGS = ("ddp", "loco", "diloco", "streaming_diloco", "tiny", "diloco_1b")


def load(name, overrides=()):
    return config_lib.load(os.path.join(common.ROOT, "configs", f"{name}.py"), overrides)


def bytes_row(name):
    overrides = ["model.scan_layers=true", "batch_size=8"] if name == "diloco_1b" else []
    cfg = load(name, overrides)
    t = Trainer(cfg, workdir=None, log=lambda *_: None)
    state, batch = t.abstract_state(), t.abstract_batch()
    period = range(cfg.diloco.sync_every + 1, 2 * cfg.diloco.sync_every + 1) if cfg.diloco.enabled else [1]
    for step in period:
        t.program(t.phase(step), state, batch)
    per_step = [t.program_bytes[str(t.phase(s))] for s in period]
    avg_dev = sum(b["per_device"] for b in per_step) / len(per_step)
    avg_cross = sum(b["cross_replica_per_replica"] for b in per_step) / len(per_step)
    peak_cross = max(b["cross_replica_per_replica"] for b in per_step)
    what = "Streaming DiLoCo" if cfg.diloco.enabled and cfg.diloco.num_fragments > 1 else (
        "DiLoCo" if cfg.diloco.enabled else "data parallel")
    setup = (f"{what}, mesh {cfg.mesh.replicas}x{t.d}, loco bits={cfg.loco.bits}"
             + (f", H={cfg.diloco.sync_every}, P={cfg.diloco.num_fragments}, tau={cfg.diloco.overlap}, "
                f"outer bits={cfg.diloco.bits}" if cfg.diloco.enabled else ""))
    return (name, setup, model_lib.count_params(t.mcfg), avg_dev, avg_cross, peak_cross, len(t._programs))


def speed(rounds, steps_per_round):
    names = ("ddp", "loco", "streaming_diloco")
    runs = {}
    for name in names:
        t = Trainer(load(name), workdir=None, log=lambda *_: None)
        state = t.init_state()
        it = t.dataset.train_iterator(seed=0)
        runs[name] = [t, state, it, 0]
    tokens = {n: r[0].cfg.batch_size * r[0].cfg.seq_len for n, r in runs.items()}

    def advance(name, n):
        t, state, it, step = runs[name]
        start = time.perf_counter()
        for _ in range(n):
            step += 1
            batch = t.put_batch(it.next_batch(t.cfg.batch_size))
            params, opt, _ = t.program(t.phase(step), state, batch)(state.params, state.opt_state, *batch)
            state = TrainState(params, opt)
            jax.block_until_ready(state)
        runs[name][1], runs[name][3] = state, step
        return time.perf_counter() - start

    for name in names:  # compile every program (a full DiLoCo period) before timing
        t = runs[name][0]
        advance(name, 2 * t.cfg.diloco.sync_every + 1 if t.cfg.diloco.enabled else 2)
    times = {n: [] for n in names}
    for r in range(rounds):
        for name in names:
            times[name].append(advance(name, steps_per_round) / steps_per_round)
        print(f"  round {r + 1}/{rounds}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.0f} ms/step" for n in names), flush=True)
    med = {n: statistics.median(v) for n, v in times.items()}
    return [(n, tokens[n] / med[n], med[n], med[n] / med["ddp"]) for n in names]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("bytes", "speed", "all"), default="all")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=10)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    lines = []
    if args.part in ("bytes", "all"):
        lines += [
            "### Parameters and bytes per step",
            "",
            "Bytes per device: all collectives of the step program (per device, averaged over one H-step period). "
            "Cross-replica: the collectives whose groups span `replica`, summed over a replica's devices.",
            "",
            "| config | setup | parameters | bytes / device / step | cross-replica bytes / replica / step (avg) | peak | programs |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for name in args.configs:
            t0 = time.time()
            row = bytes_row(name)
            print(f"  {name}: {row[2]:,} params, {common.human(row[3])}/device/step ({time.time() - t0:.0f} s)", flush=True)
            n, setup, params, dev, cross, peak, programs = row
            lines.append(f"| {n} | {setup} | {params:,} | {common.human(dev)} | {common.human(cross)} | "
                         f"{common.human(peak)} | {programs} |")
        lines.append("")
    if args.part in ("speed", "all"):
        rows = speed(args.rounds, args.steps_per_round)
        lines += [
            "### Tokens per second on this CPU (side by side)",
            "",
            f"Median over {args.rounds} interleaved rounds of {args.steps_per_round} steps; the three configs share the "
            "model size, batch and sequence length. On CPU the 'network' is memory copies between simulated devices, "
            "so this measures the compute cost of each method, not a network speed-up.",
            "",
            "| config | tokens/s | ms/step | time vs ddp |",
            "|---|---:|---:|---:|",
        ] + [f"| {n} | {tps:,.0f} | {ms * 1e3:.0f} | {ratio:.2f}x |" for n, tps, ms, ratio in rows]
    common.report(HEADING, "\n".join(lines), no_write=args.no_write, extra_args=sys.argv[1:])


if __name__ == "__main__":
    main()
