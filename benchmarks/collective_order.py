"""Every step program of a matrix of trainer layouts, compiled for 8 CPU devices: its unordered collectives.

XLA:CPU runs the independent operations of a program in no fixed order, on each device apart; two collectives
that no data or control dependence orders may start in a different order on two devices, and the run then
waits in a rendezvous until XLA aborts it (issue 40). ``collectives.after`` ties them on CPU. This walks the
product of the knobs that change which collectives a step holds (FSDP, scanned layers, remat, micro-batches,
the in-backward exchange, LoCo's quantized or exact exchange), with Streaming DiLoCo (an exchange phase and
a quiet one) or without it, and prints, per layout, the count of unordered pairs (:func:`loco_jax.hlo.unordered_collectives`)
and the first few. Exit status 1 if any layout has one.

    python benchmarks/collective_order.py            # the whole matrix (about 30 minutes on one core)
    python benchmarks/collective_order.py --quick    # FSDP with remat or micro-batches
    python benchmarks/collective_order.py --only diloco.enabled=False   # data parallel's layouts
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

KNOBS = {
    "diloco.enabled": (True, False),
    "mesh.fsdp": (False, True),
    "model.remat": (False, True),
    "accum_steps": (1, 2),
    "loco.in_backward": (False, True),
    "loco.bits": (4, None),
}


def layouts(quick=False):
    """Dicts of ``--set`` overrides. ``quick``: only those that combine FSDP with remat or micro-batches."""
    out = []
    for values in itertools.product(*KNOBS.values()):
        sets = dict(zip(KNOBS, values), **{"model.scan_layers": True})
        if not sets["diloco.enabled"]:
            sets["mesh.replicas"] = 1  # data parallel over all 8 devices
        if quick and not (sets["mesh.fsdp"] and (sets["model.remat"] or sets["accum_steps"] > 1)):
            continue
        out.append(sets)
    # unscanned layers (no per-layer gather) with FSDP and micro-batches
    out.append({"mesh.fsdp": True, "model.scan_layers": False, "accum_steps": 2})
    return out


def check(sets, text_file, workdir):
    """``[(phase, pairs)]`` for one layout: its quiet step and its first exchange phase."""
    from loco_jax import hlo
    from loco_jax.training.run.trainer import Trainer
    from tests.helpers import small_config

    t = Trainer(small_config(text_file, **sets), workdir, log=lambda *a, **k: None)
    state, batch = t.init_state(), t.abstract_batch()
    phases = {}
    for step in range(1, t.cfg.diloco.sync_every + 2 if t.cfg.diloco.enabled else 2):
        phase = t.phase(step)
        phases.setdefault(None if phase is None else (phase.send is None, phase.apply is None), phase)
    return [(phase, [str(p) for p in hlo.unordered_collectives(t.program(phase, state, batch))])
            for phase in phases.values()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only FSDP with remat or micro-batches")
    parser.add_argument("--only", action="append", default=[], metavar="KEY=VALUE",
                        help="only the layouts with this setting (e.g. diloco.enabled=False); repeatable")
    args = parser.parse_args(argv)
    only = [tuple(x.split("=", 1)) for x in args.only]
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        text_file = os.path.join(tmp, "text.txt")
        with open(text_file, "w") as f:
            f.write("the quick brown fox jumps over the lazy dog. " * 2000)
        for sets in layouts(args.quick):
            if any(str(sets.get(k)) != v for k, v in only):
                continue
            for phase, pairs in check(sets, text_file, tmp):
                bad += bool(pairs)
                name = " ".join(f"{k}={v}" for k, v in sets.items())
                print(f"{len(pairs):4d} unordered pairs  {name}  {phase}", flush=True)
                for p in pairs[:3]:
                    print("       ", p[:300])
    print("every layout orders its collectives" if not bad else f"{bad} programs with unordered collectives")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
