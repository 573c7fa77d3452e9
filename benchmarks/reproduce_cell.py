"""Does today's code reproduce an archived cell? Runs its first steps and compares the logged losses.

    python benchmarks/reproduce_cell.py par_dp_lr0.002_s0 [--steps 100]

The cell's own config (from the script that defines it: quality.py, parity.py, sparse_parity.py or
loco_long.py), trained for ``--steps`` steps in a temporary workdir with the run's full-length schedule
(``stop_after``), then each logged row's ``loss`` (and ``eval_loss`` where one falls in) beside the archived
``benchmarks/results/CELL-KEY/metrics.jsonl``. Exit status 0 when every compared value is identical to the
bit, 1 otherwise. Used to find which commit changed the numbers (``git bisect run``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/
from benchmarks import common, quality  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cell")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args(argv)
    from benchmarks import loco_long, parity, sparse_parity  # noqa: F401 (each registers its cells)
    parity.cells()
    sparse_parity.cells()
    loco_long.cells()
    if args.cell not in quality.OVERRIDES:
        raise SystemExit(f"unknown cell {args.cell!r}; see the benchmarks' --list")
    archived = glob.glob(os.path.join(quality.ARCHIVE, f"{args.cell}-*", "metrics.jsonl"))
    if not archived:
        raise SystemExit(f"{args.cell} has no archived record under {os.path.relpath(quality.ARCHIVE, common.ROOT)}")
    from loco_jax.training.run import config as config_lib
    from loco_jax.training.run.loop import train_and_evaluate
    cfg = config_lib.load(os.path.join(common.ROOT, "configs", "ddp.py"), quality.BASE + quality.OVERRIDES[args.cell])
    old = {r["step"]: r for r in map(json.loads, open(archived[0]))}
    with tempfile.TemporaryDirectory() as workdir:
        train_and_evaluate(cfg, workdir, log=lambda *a: None, stop_after=args.steps)
        rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    same = True
    for row in rows:
        ref = old.get(row["step"], {})
        for key in ("loss", "eval_loss"):
            if key in row and key in ref:
                equal = row[key] == ref[key]
                same &= equal
                print(f"step {row['step']} {key}: {row[key]!r} archived {ref[key]!r} {'same' if equal else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
