"""FSDP against replicated state on the tiny recipe: the same losses, and tokens/s side by side.

    python benchmarks/fsdp.py [--steps 50] [--repeats 2] [--seeds 0,1,2] [--no-write]

``configs/tiny.py`` (Streaming DiLoCo over 2 replicas x 4 devices, clipping at 1.0) trained for
``--steps`` steps with ``mesh.fsdp`` off and on, in fp32 compute:

- exact: LoCo off and an fp32 outer exchange; the losses of every step are compared (relative gap);
- LoCo 4-bit with the 4-bit outer exchange (the recipe's own settings), per seed of ``--seeds``: final
  eval losses compared. The two layouts bucket the gradient differently (FSDP cuts each leaf on its
  shard dimension) and replicated re-quantizes the reduced mean (FSDP's reduce-scatter has no second
  stage), so the quantized values differ and the runs part ways. Beside each pair, a control: the
  replicated run again with ``loco.bucket_size`` set (CONTROL_BUCKET values per bucket), the same
  algorithm, data and initial parameters with other quantization blocks and rotations. Its gap is the
  noise floor of any two layouts that do not quantize the same blocks.

Speed: the exact pair runs ``--repeats`` times, alternating, and tokens/s is the median over the
logged intervals after the first (which holds compilation); the ratio FSDP / replicated is what to
read on a shared machine. On CPU the all-gather of the parameters each step is a copy the replicated
step does not make, and nothing overlaps it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/
from benchmarks import common  # noqa: E402  (sets XLA_FLAGS before jax is imported)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from loco_jax.training.run import config as config_lib  # noqa: E402
from loco_jax.training import model as model_lib  # noqa: E402
from loco_jax.training.run.loop import train_and_evaluate  # noqa: E402
from loco_jax.training.run.metrics import read_metrics  # noqa: E402

HEADING = "## FSDP against replicated state (benchmarks/fsdp.py)"
HLO_HEADING = "## Wire bytes of the trainer's step: replicated, FSDP, hierarchical (benchmarks/fsdp.py --hlo)"

LAYOUTS = {  # data parallel on 8 devices, the tiny model (scanned layers, so FSDP cuts off the layer axis)
    "replicated": [],
    "FSDP (1/8 of the state per device)": ["mesh.fsdp=true"],
    "hierarchical: 2 hosts x 4 devices": ["mesh.data=2", "mesh.local=4"],
}


def step_bytes(sets):
    """Per device, from the compiled step: bytes by payload dtype, and the bytes crossing hosts of 4 devices."""
    import tempfile as _tempfile

    from loco_jax import hlo
    from loco_jax.training.run.trainer import Trainer

    base = ["mesh.replicas=1", "diloco.enabled=false", "model.scan_layers=true", "sample_tokens=0"]
    cfg = config_lib.load(os.path.join(common.ROOT, "configs", "tiny.py"), base + sets)
    with _tempfile.TemporaryDirectory() as workdir:
        t = Trainer(cfg, workdir, log=lambda *a: None)
        report = hlo.collective_bytes(t.program(None, t.abstract_state(), t.abstract_batch()))
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model_lib.abstract_params(t.mcfg)))
    by_dtype = {}
    for op in report.ops:
        for dtype, size in op.bytes_by_dtype().items():
            by_dtype[dtype] = by_dtype.get(dtype, 0.0) + size
    across = sum(op.total_bytes for op in report.ops if op.spans(4))
    across_float = sum(op.total_bytes for op in report.ops if op.spans(4) and op.dtype != "u8")
    return report.total, by_dtype, across, across_float, n


def hlo_table():
    rows, n = [], 0
    for name, sets in LAYOUTS.items():
        for label, bits in (("exact fp32", ["loco.bits=None"]), ("LoCo 4-bit", ["loco.bits=4"])):
            total, by_dtype, across, across_float, n = step_bytes(sets + bits)
            rows.append(f"| {name} | {label} | {common.human(total)} | {common.human(by_dtype.get('u8', 0))} | "
                        f"{common.human(by_dtype.get('u16', 0))} | {common.human(by_dtype.get('f32', 0))} | "
                        f"{common.human(across)} | {common.human(across_float)} |")
    lines = [f"The tiny model ({n:,} parameters, scanned layers) as data parallel on 8 devices; bytes per device per "
             "step read from the compiled step program (`hlo.collective_bytes`). \"across hosts\": collectives whose "
             "device groups span the 4-device blocks (the hosts of the hierarchical layout; for the other layouts "
             "the same split shows what would cross such hosts).", "",
             "| layout | gradient exchange | total | uint8 | uint16 | fp32 | across hosts | of which not uint8 |",
             "|---|---|---:|---:|---:|---:|---:|---:|"] + rows
    lines += ["", "uint16 is FSDP's all-gather of the parameters in the recipe's bf16 compute dtype (sent as bit "
              "patterns); with it FSDP keeps only the reduce-scatter half of the gradient exchange (exact: fp32; "
              "LoCo: uint8). The hierarchical layout sends the gradient across hosts as uint8 only, plus scalars; "
              "its fp32 traffic (the exact reduce-scatter and all-gather of each host's shard) stays inside a host."]
    return "\n".join(lines)


CONTROL_BUCKET = 2**17  # about 1/7 of the tiny model: eight buckets in place of one


def run(steps, fsdp, exact, seed=0, extra=()):
    sets = [f"steps={steps}", "log_every=1", f"eval_every={steps}", f"checkpoint_every={steps}", "sample_tokens=0",
            "model.compute_dtype=float32", f"mesh.fsdp={fsdp}", f"seed={seed}", *extra]
    if exact:
        sets += ["loco.bits=None", "diloco.bits=None"]
    cfg = config_lib.load(os.path.join(common.ROOT, "configs", "tiny.py"), sets)
    with tempfile.TemporaryDirectory() as workdir:
        train_and_evaluate(cfg, workdir, log=lambda *a: None)
        rows = read_metrics(workdir)
    losses = [r["loss"] for r in rows if "loss" in r]
    speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][1:]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    return losses, evals[-1], statistics.median(speeds)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the LoCo 4-bit pairs, comma-separated")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--hlo", action="store_true", help="only the wire-bytes table (compiles, trains nothing)")
    args = parser.parse_args(argv)
    started = common.start()
    if args.hlo:
        common.report(HLO_HEADING, hlo_table(), no_write=args.no_write, extra_args=sys.argv[1:], started=started)
        return
    exact = {False: [], True: []}
    for _ in range(args.repeats):
        for fsdp in (False, True):
            exact[fsdp].append(run(args.steps, fsdp, exact=True))
    rep, sharded = exact[False][0], exact[True][0]
    gaps = [abs(a - b) / abs(a) for a, b in zip(rep[0], sharded[0])]
    speed = {k: statistics.median(r[2] for r in v) for k, v in exact.items()}
    seeds = [int(x) for x in args.seeds.split(",")]
    pairs = []  # (seed, replicated, FSDP, control) final eval losses
    for seed in seeds:
        rep_eval, fsdp_eval, control_eval = (
            run(args.steps, fsdp, exact=False, seed=seed, extra=extra)[1]
            for fsdp, extra in ((False, ()), (True, ()), (False, (f"loco.bucket_size={CONTROL_BUCKET}",))))
        pairs.append((seed, rep_eval, fsdp_eval, control_eval))
    gap = lambda a, b: 100 * (b - a) / a
    lines = [
        f"`configs/tiny.py` for {args.steps} steps, fp32 compute, clipping at 1.0, Streaming DiLoCo over 2 replicas "
        "x 4 devices (FSDP: 1/4 of the state per device).", "",
        "| run | replicated | FSDP | gap |", "|---|---:|---:|---:|",
        f"| exact: largest relative loss gap over the {len(gaps)} steps | | | {max(gaps):.2e} |",
        f"| exact: final eval loss | {rep[1]:.6f} | {sharded[1]:.6f} | {(sharded[1] - rep[1]) / rep[1]:+.2e} |",
        f"| exact: tokens/s (median of {args.repeats} alternating runs) | {speed[False]:,.0f} | {speed[True]:,.0f} | "
        f"{speed[True] / speed[False]:.2f}x |",
        "",
        f"LoCo 4-bit with the 4-bit outer exchange, final eval loss per seed (same seed: same data order and initial "
        f"parameters). Control: replicated again with `loco.bucket_size={CONTROL_BUCKET}` (other quantization blocks "
        "and rotations, the same algorithm).", "",
        "| seed | replicated | FSDP | FSDP gap | control | control gap |", "|---:|---:|---:|---:|---:|---:|",
    ]
    for seed, r, f, c in pairs:
        lines.append(f"| {seed} | {r:.4f} | {f:.4f} | {gap(r, f):+.2f} % | {c:.4f} | {gap(r, c):+.2f} % |")
    fsdp_gaps = [gap(r, f) for _, r, f, _ in pairs]
    control_gaps = [gap(r, c) for _, r, _, c in pairs]
    lines += [
        f"| mean | | | {statistics.mean(fsdp_gaps):+.2f} % | | {statistics.mean(control_gaps):+.2f} % |",
        f"| mean of the absolute gaps | | | {statistics.mean(map(abs, fsdp_gaps)):.2f} % | | "
        f"{statistics.mean(map(abs, control_gaps)):.2f} % |",
        "",
        "Targets (issue 13): losses within 1e-5 relative at every step; LoCo 4-bit final eval losses within 0.5 %.",
    ]
    common.report(HEADING, "\n".join(lines), no_write=args.no_write, extra_args=sys.argv[1:], started=started)


if __name__ == "__main__":
    main()
