"""Host time against device time per training step: the loop before and after async dispatch.

    python benchmarks/host_time.py                    # configs/tiny.py on 8 CPU devices, both loops side by side
    python benchmarks/host_time.py --steps 20 --no-write
    PYTHONPATH=. python benchmarks/host_time.py --config configs/diloco_1b.py --set mesh.replicas=1 \\
        --set diloco.enabled=false --set batch_size=8 --synthetic-shards /tmp/shards --no-before   # one GPU

Each run is the real ``train_and_evaluate`` on a fresh workdir: ``--steps`` steps, logging, evaluating and
checkpointing only at the last one, so every other step is quiet. Two probes, patched in for the run:

- ``Trainer.program`` is called once per step: the time between consecutive calls is the loop's wall
  time per step (the first ``--skip`` steps, which compile, are left out);
- ``jax.block_until_ready`` (the CPU backend's guard against XLA's CPU-collective deadlock waits on
  every step with it) is timed: the wall time not spent waiting in it is host time (Python, batch,
  dispatch). Off CPU the loop does not block, so host time there is the loop's wall time per step
  while the host runs ahead of the device.

Device time per step is the same compiled step program run back to back on one batch, blocking each.
"Before" is the loop as it was before issue 12 (``loco_jax/trainer.py`` at commit ``BEFORE``, read with
``git show``): one device read per step for the DiLoCo phase, one for the skip count, and the batch
cut after the previous step finished. On 2 CPU cores every step still blocks and Python competes with
XLA's threads for the cores, so only the host's share can shrink here; the real figure is a GPU's.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/
from benchmarks import common  # noqa: E402  (sets XLA_FLAGS before jax is imported)

import jax  # noqa: E402

from loco_jax.training.run import config as config_lib  # noqa: E402
from loco_jax.training.data import shard_writer  # noqa: E402
from loco_jax.training.run import loop  # noqa: E402
from loco_jax.training.run.trainer import Trainer  # noqa: E402

HEADING = "## Host time against device time per step (benchmarks/host_time.py)"
BEFORE = "9e6d369"  # the last commit with the loop that read the device every step


def _old_trainer_module():
    """The pre-issue-12 ``loco_jax/trainer.py`` as a module (it imports the current library and app modules)."""
    source = subprocess.run(["git", "show", f"{BEFORE}:loco_jax/trainer.py"], cwd=common.ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "trainer_before.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("trainer_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Probe:
    """Timestamps of the per-step program calls and the time spent blocked in between."""

    def __init__(self, trainer_cls):
        self.trainer_cls, self.calls, self.blocked = trainer_cls, [], []

    def __enter__(self):
        self._program, self._block = self.trainer_cls.program, jax.block_until_ready
        probe = self

        def program(trainer_self, *args):
            probe.calls.append(time.perf_counter())
            probe.blocked.append(0.0)
            return probe._program(trainer_self, *args)

        def block(x):
            t0 = time.perf_counter()
            out = probe._block(x)
            if probe.blocked:
                probe.blocked[-1] += time.perf_counter() - t0
            return out

        self.trainer_cls.program, jax.block_until_ready = program, block
        return self

    def __exit__(self, *exc):
        self.trainer_cls.program, jax.block_until_ready = self._program, self._block

    def per_step(self, skip):
        """(wall, host) medians in seconds over the quiet steps after ``skip``."""
        walls = [b - a for a, b in zip(self.calls[skip:-1], self.calls[skip + 1:])]
        hosts = [w - blocked for w, blocked in zip(walls, self.blocked[skip:-1])]
        return statistics.median(walls), statistics.median(hosts)


def device_time(cfg, repeats):
    """Median seconds of one compiled step program on one batch, back to back, blocking each."""
    t = Trainer(config_lib.resolve(cfg), tempfile.mkdtemp())
    state = t.init_state()
    batches = t.dataset.train_iterator(seed=cfg.data.seed)
    batch = t.put_batch(batches.next_batch(cfg.batch_size))
    prog = t.program(t.phase(1), state, batch)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        params, opt_state, _ = jax.block_until_ready(prog(state.params, state.opt_state, *batch))
        state = state._replace(params=params, opt_state=opt_state)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def run_loop(train, trainer_cls, cfg, skip):
    with Probe(trainer_cls) as probe:
        train(cfg, tempfile.mkdtemp(), log=lambda *_: None)
    return probe.per_step(skip)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=4, help="first steps left out (compiles)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each loop, interleaved")
    ap.add_argument("--no-before", action="store_true", help="only the current loop (no git history needed)")
    ap.add_argument("--synthetic-shards", default=None, metavar="DIR",
                    help="write random-token shards for the config's vocabulary here and train on them")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    overrides = args.overrides + [f"steps={args.steps}", f"log_every={args.steps}", f"eval_every={args.steps}",
                                  f"checkpoint_every={args.steps}", "eval_batches=1", "sample_tokens=0"]
    cfg = config_lib.load(args.config, overrides)
    if args.synthetic_shards:
        import numpy as np

        n = cfg.batch_size * cfg.seq_len * (args.steps + 8)
        tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, n, dtype=np.int64)
        shard_writer.write_token_shards(args.synthetic_shards, tokens, tokens[: 4 * cfg.batch_size * (cfg.seq_len + 1)],
                                        vocab_size=cfg.model.vocab_size)  # "external" ids: only the vocabulary is checked
        cfg = config_lib.override(cfg, [f"data.path={args.synthetic_shards}", "data.tokenizer=byte"])
    variants = [("after: async loop", loop.train_and_evaluate, Trainer)]
    if not args.no_before:
        old = _old_trainer_module()
        variants.insert(0, ("before: a device read per step", old.train_and_evaluate, old.Trainer))
    results = {name: [] for name, _, _ in variants}
    for _ in range(args.repeats):
        for name, train, cls in variants:
            results[name].append(run_loop(train, cls, cfg, args.skip))
            print(f"  {name}: wall {results[name][-1][0] * 1e3:.1f} ms/step, host {results[name][-1][1] * 1e3:.1f}",
                  flush=True)
    device = device_time(cfg, repeats=10)

    lines = [
        f"Config: `{args.config}`" + (f" with {' '.join('`--set ' + o + '`' for o in args.overrides)}" if args.overrides else "")
        + f"; {args.steps} steps per run, the first {args.skip} (compiling) left out, {args.repeats} runs of each loop "
        "interleaved; medians over the quiet steps, then the median of the runs.",
        "",
        "| loop | wall ms/step | host ms/step (not waiting on the device) | host share of the wall |",
        "|---|---:|---:|---:|",
    ]
    for name, runs in results.items():
        wall, host = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        lines.append(f"| {name} | {wall * 1e3:.1f} | {host * 1e3:.1f} | {host / wall:.0%} |")
    lines += ["", f"Device time per step (the step program alone, back to back, blocking each): {device * 1e3:.1f} ms."]
    if len(results) == 2:
        (_, a), (_, b) = results.items()
        ratio = statistics.median(r[0] for r in b) / statistics.median(r[0] for r in a)
        lines.append(f"Wall time per step, after / before: {ratio:.2f}.")
    if jax.default_backend() == "cpu":
        lines += ["", "On CPU every step blocks (XLA's CPU collectives can deadlock with several multi-device programs "
                  "in flight), and Python shares the 2 cores with XLA's threads: what the async loop removes here is "
                  "the per-step reads and the batch cut after the step, not the wait. Host time is the part of the "
                  "step the host spends outside that wait; on a GPU, where nothing blocks, the loop keeps the device "
                  "busy while host time stays below device time (`benchmarks/gpu_check.sh`)."]
    common.report(HEADING, "\n".join(lines), no_write=args.no_write, extra_args=sys.argv[1:])


if __name__ == "__main__":
    main()
