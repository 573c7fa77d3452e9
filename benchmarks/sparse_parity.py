"""Sparse outer gradients (SparseLoCo class) and Muon inside, against data parallel: parity.py's protocol.

    python benchmarks/sparse_parity.py --list            # every cell and its train.py command line
    python benchmarks/sparse_parity.py --group tune      # seed 0, M = 2: two densities x two outer rules
    python benchmarks/sparse_parity.py --group final     # seeds 1-3, M = 2 and 4, the chosen sparse cell
    python benchmarks/sparse_parity.py --group muon      # seeds 1-3, M = 2: Muon inner, DP / dense / sparse
    python benchmarks/sparse_parity.py --report

Model, data, run length (3,000 steps), H = 30, 3 fragments, overlap 1 and the tuned Streaming DiLoCo
settings are benchmarks/parity.py's (its seed-0 selection for each M: outer lr 0.7, alpha 0, inner lr
5e-3, outer momentum 0.8 at M = 2 and 0.9 at M = 4). The sparse cells change only the exchange:
``diloco.density`` of each 4,096-entry chunk, 2-bit values, an fp32 error-feedback accumulator, and one of
the two outer rules: ``nesterov`` (the tuned Nesterov outer step on the decoded mean, plain error feedback)
or ``ef`` (SparseLoCo's: plain SGD at outer lr 1 with the accumulator decayed by 0.95 in place of the
momentum). The dense and data-parallel references are parity.py's finished cells (same seeds, same data
order, same tokens): gaps are paired per seed.
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/
from benchmarks import common, parity, quality  # noqa: E402

HEADING = "## Sparse outer gradients and Muon inside, at parity with data parallel (benchmarks/sparse_parity.py)"
DENSITIES = {"d3": 0.03, "d1": 0.01}
RULES = {
    "nesterov": lambda s: [],  # the tuned outer step; error_decay None: plain error feedback
    "ef": lambda s: ["diloco.outer_momentum=0.0", "diloco.outer_lr=1.0", "diloco.error_decay=0.95"],
}
MUON = ["optim.name=muon"]


def _sparse(seed, m, density, rule):
    s = parity.selection()[("stream", m)]
    return parity._stream(seed, parity.LONG, m, 2, s, "stream2") + [f"diloco.density={density}"] + RULES[rule](s)


def tune_cells():
    return {f"sp_m2_{d}_{rule}_s0": ("tune", _sparse(0, 2, density, rule))
            for d, density in DENSITIES.items() for rule in RULES}


def chosen():
    """The seed-0 tune cell with the lowest final eval loss, or None until every tune cell has finished."""
    names = list(tune_cells())
    if not all(quality.finished(n) for n in names):
        return None
    return min(names, key=quality.final)


def _parts(name):
    _, _, d, rule, _ = name.split("_")
    return d, rule


def seeded_cells():
    out = {}
    best = chosen()
    if best is None:
        return out
    d, rule = _parts(best)
    for seed in parity.SEEDS:
        for m in (2, 4):
            out[f"sp_m{m}_{d}_{rule}_3000_s{seed}"] = ("final", _sparse(seed, m, DENSITIES[d], rule))
        out[f"muon_dp_3000_s{seed}"] = ("muon", parity._dp(seed, parity.LONG, parity.selection()["dp"]) + MUON)
        out[f"muon_m2_stream4rot_3000_s{seed}"] = (
            "muon", parity._stream(seed, parity.LONG, 2, 4, parity.selection()[("stream", 2)], "stream4rot") + MUON)
        out[f"muon_sp_m2_{d}_{rule}_3000_s{seed}"] = ("muon", _sparse(seed, 2, DENSITIES[d], rule) + MUON)
    return out


def cells():
    parity.cells()  # registers the references
    tune = quality.register(tune_cells())
    return dict(tune, **quality.register(seeded_cells()))


def _loss(name):
    return f"{quality.final(name):.4f}" if quality.finished(name) else "running or queued"


def _gap(name, ref):
    if not (quality.finished(name) and quality.finished(ref)):
        return None
    return 100 * (quality.final(name) / quality.final(ref) - 1)


def tune_table():
    ref = "par_dp_lr0.002_s0"
    lines = [f"Seed 0, M = 2, {parity.LONG:,} steps; gap to data parallel at its chosen lr (`{ref}`) and to the "
             "tuned dense 4-bit exchange (`par_m2_stream4_momentum0.8_alpha0_lr0.005_s0`, the int exchange it was "
             "tuned with).", "",
             "| cell | density | outer rule | final eval loss | gap to DP | gap to dense 4-bit |",
             "|---|---:|---|---:|---:|---:|"]
    best = chosen()
    for name in tune_cells():
        d, rule = _parts(name)
        mark = " (chosen)" if name == best else ""
        lines.append(f"| `{name}`{mark} | {100 * DENSITIES[d]:g} % | {rule} | {_loss(name)} | "
                     f"{parity._fmt(_gap(name, ref))} | "
                     f"{parity._fmt(_gap(name, 'par_m2_stream4_momentum0.8_alpha0_lr0.005_s0'))} |")
    return "\n".join(lines)


def _paired(names_refs):
    gaps = [_gap(n, r) for n, r in names_refs]
    if any(g is None for g in gaps):
        return "running or queued"
    sd = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
    return f"{statistics.mean(gaps):+.2f} % (sd {sd:.2f}; " + ", ".join(f"{g:+.2f}" for g in gaps) + ")"


def final_table():
    best = chosen()
    if best is None:
        return "The seeded cells wait for the tune cells."
    d, rule = _parts(best)
    rows = ["| cell (seeds 1-3) | M | mean paired gap to data parallel (per seed) | to dense 4-bit rotated |",
            "|---|---:|---|---|"]
    for m in (2, 4):
        names = [f"sp_m{m}_{d}_{rule}_3000_s{s}" for s in parity.SEEDS]
        dp = [f"par_dp_3000_s{s}" for s in parity.SEEDS]
        dense = [f"par_m{m}_stream4rot_3000_s{s}" for s in parity.SEEDS]
        rows.append(f"| `sp_m{m}_{d}_{rule}_3000` | {m} | {_paired(zip(names, dp))} | {_paired(zip(names, dense))} |")
    for label, names, refs in [
        ("Muon, data parallel", [f"muon_dp_3000_s{s}" for s in parity.SEEDS], None),
        ("Muon, dense 4-bit rotated", [f"muon_m2_stream4rot_3000_s{s}" for s in parity.SEEDS], None),
        (f"Muon, sparse {d} {rule}", [f"muon_sp_m2_{d}_{rule}_3000_s{s}" for s in parity.SEEDS], None),
    ]:
        dp = [f"par_dp_3000_s{s}" for s in parity.SEEDS]
        muon_dp = [f"muon_dp_3000_s{s}" for s in parity.SEEDS]
        rows.append(f"| {label} | {1 if 'data parallel' in label else 2} | {_paired(zip(names, dp))} "
                    f"(to Muon DP: {_paired(zip(names, muon_dp))}) | |")
    return "\n".join(rows)


def report(no_write, extra_args):
    cells()
    body = "\n\n".join([
        __doc__.split("\n\n", 1)[1].strip(),
        "Each cell's command: `python benchmarks/sparse_parity.py --list`.",
        "### Tuning on seed 0", tune_table(),
        f"### Seeds 1-3 at {parity.LONG:,} steps", final_table(),
    ])
    common.report(HEADING, body, no_write=no_write, extra_args=extra_args)


def main(argv=None):
    quality.cli(__doc__, ("tune", "final", "muon"), cells(), report, argv)


if __name__ == "__main__":
    main()
