"""LoCo's compensation over 3,000 steps: does ``compress(bits=4)`` or ``compress(bits=2)`` want error feedback?

    python benchmarks/loco_long.py --list        # every cell and its train.py command line
    python benchmarks/loco_long.py --group shakespeare   # seeds 1-3 on the trainer's default text
    python benchmarks/loco_long.py --group text2         # seeds 1-2 on the second text (benchmarks/second_text.py)
    python benchmarks/loco_long.py --report

Data parallel on 8 devices, benchmarks/parity.py's protocol (its 919k-parameter model, 16 x 64 tokens per
step, 3,000 steps, AdamW at data parallel's tuned lr 2e-3), the gradient mean exchanged by
``loco.compress`` at 4 and 2 bits in the measured defaults' format (``lloyd`` levels, rotated), with each
compensation: none (``naive``), plain error feedback (``ef``: beta 0) and LoCo's moving average (``loco``:
beta 0.8), plus LoCo's reference settings at 4 bits (``ref4``: int absmax, no rotation, beta 0.8) and the
exact fp32 mean (``fp32``). Every cell of one seed sees the same data order and evaluates on the same
windows: gaps to ``fp32`` are paired per seed.
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/
from benchmarks import common, parity, quality, second_text  # noqa: E402

HEADING = "## LoCo's compensation over 3,000 steps (benchmarks/loco_long.py)"
DP_LR = 2e-3  # parity.py's data-parallel selection at 3,000 steps
TEXTS = {"shakespeare": ((1, 2, 3), []),
         "text2": ((1, 2), [f"data.path={os.path.relpath(second_text.OUT, common.ROOT)}"])}
VARIANTS = {
    "fp32": [],
    **{f"{rule}{b}": [f"loco.bits={b}", "loco.format=lloyd", "loco.rotate=true"] + extra
       for b in (4, 2) for rule, extra in (("naive", ["loco.compensate=false"]),
                                            ("ef", ["loco.compensate=true", "loco.beta=0.0"]),
                                            ("loco", ["loco.compensate=true", "loco.beta=0.8"]))},
    "ref4": ["loco.bits=4", "loco.preset=reference"],
}


# exact-mean cells already run on today's init, with the same resolved config (sparse_parity.py's data parallel
# references at 3,000 steps, refs41 and text41): reused under their own names. (par_dp_3000_s* and
# kjv_dp_3000_s1 share their keys but ran before cf4d0aa changed the replicated init: not paired to the bit.)
ALIASES = {**{("shakespeare", "fp32", s): f"sp41_ref_dp_s{s}" for s in (1, 2, 3)},
           **{("text2", "fp32", s): f"kjv41_ref_dp_s{s}" for s in (1, 2)}}


def cell_name(text, variant, seed):
    return ALIASES.get((text, variant, seed), f"ll_{text}_{variant}_s{seed}")


def cells():
    out = {}
    for text, (seeds, data) in TEXTS.items():
        for seed in seeds:
            for variant, sets in VARIANTS.items():
                out[cell_name(text, variant, seed)] = (text, parity.dp_overrides(seed, parity.LONG, DP_LR) + data + sets)
    return quality.register(out)


def table():
    lines = ["Final eval loss relative to the exact fp32 mean of the same seed (paired), per text: mean and sd "
             "over the seeds, then each seed.", "",
             "| text | variant | mean gap | sd | each seed |", "|---|---|---:|---:|---|"]
    for text, (seeds, _) in TEXTS.items():
        for variant in VARIANTS:
            if variant == "fp32":
                continue
            gaps = []
            for seed in seeds:
                name, ref = cell_name(text, variant, seed), cell_name(text, "fp32", seed)
                if quality.finished(name) and quality.finished(ref):
                    gaps.append(100 * (quality.final(name) / quality.final(ref) - 1))
            mean = f"{statistics.mean(gaps):+.2f} %" if gaps else "-"
            sd = f"{statistics.stdev(gaps):.2f}" if len(gaps) > 1 else "-"
            lines.append(f"| {text} | {variant} | {mean} | {sd} | {', '.join(f'{g:+.2f}' for g in gaps)} "
                         f"({len(gaps)} of {len(seeds)}) |")
    return "\n".join(lines)


def report(no_write, extra_args):
    cells()
    body = "\n\n".join([__doc__.split("\n\n", 1)[1].strip(),
                        "Each cell's command: `python benchmarks/loco_long.py --list`.", table()])
    common.report(HEADING, body, no_write=no_write, extra_args=extra_args)


def main(argv=None):
    quality.cli(__doc__, tuple(TEXTS), cells(), report, argv)


if __name__ == "__main__":
    main()
