"""Sparse outer gradients (SparseLoCo class) and Muon inside, against data parallel: parity.py's protocol.

    python benchmarks/sparse_parity.py --list            # every cell and its train.py command line
    python benchmarks/sparse_parity.py --group tune      # seed 0, M = 2: two densities x two outer rules
    python benchmarks/sparse_parity.py --group final     # seeds 1-3, M = 2 and 4, the chosen sparse cell
    python benchmarks/sparse_parity.py --group muon      # seeds 1-3, M = 2: Muon inner, DP / dense / sparse
    python benchmarks/sparse_parity.py --group text2     # seed 1, M = 2, on the second text: DP and the chosen cell
    python benchmarks/sparse_parity.py --group grid      # seeds 1-3, M = 2 and 4: the other density x rule cells
    python benchmarks/sparse_parity.py --group probe     # seed 0, M = 2: moves tried after the seeds had run
    python benchmarks/sparse_parity.py --group tune4     # seed 0, M = 4: both rules at the chosen density and move
    python benchmarks/sparse_parity.py --group outer     # seed 0, M = 2 and 4: outer lr x the sparse mean's divisor
    python benchmarks/sparse_parity.py --group refs41    # seeds 1-3: the references on today's init, the senders' cell
    python benchmarks/sparse_parity.py --group tune41    # seed 0, M = 2 and 4: decay, alpha, 1 % around the senders' cell
    python benchmarks/sparse_parity.py --group quant41   # seed 0, M = 2 and 4: SparseLoCo's values quantizer there
    python benchmarks/sparse_parity.py --group topo41    # seed 0, M = 2 and 4: the paper's topology, H = 15 and 30
    python benchmarks/sparse_parity.py --group tiles41   # seed 0, M = 2 and 4: chunks that follow the leaves
    python benchmarks/sparse_parity.py --group text41    # seeds 1-2, M = 2, the second text: DP, dense, senders
    python benchmarks/sparse_parity.py --group seeds41   # seeds 1-3, M = 2: 1.5 % and 1 % at lr 2, decay 0.9; 3 % at decay 0.9
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
from benchmarks import common, parity, quality, second_text  # noqa: E402

HEADING = "## Sparse outer gradients and Muon inside, at parity with data parallel (benchmarks/sparse_parity.py)"
DENSITIES = {"d3": 0.03, "d1": 0.01}
RULES = {
    "nesterov": lambda s: [],  # the tuned outer step; error_decay None: plain error feedback
    "ef": lambda s: ["diloco.outer_momentum=0.0", "diloco.outer_lr=1.0", "diloco.error_decay=0.95"],
}
MUON = ["optim.name=muon"]


# A second round on seed 0, moved from the better rule at the better density of the first: alpha 0.5 keeps
# half of each replica's local progress at a merge (the first round measured the density as the lever: what
# a round does not send is held back from the model until it is sent).
MOVES = {"alpha0.5": ["diloco.alpha=0.5"]}
# Moves tried on seed 0 after the seeded cells had run from the choice above. They are reported beside the
# tune cells but do not take part in the choice: changing it would rename (and orphan) every seeded cell.
# keep: each replica restarts from the global parameters less its own decayed accumulator (diloco's
# keep_unsent, alpha 0), so what a round does not send stays in the replica that made it.
PROBES = {"alpha0.75": ["diloco.alpha=0.75"], "keep": ["diloco.keep_unsent=true"]}
_ALL_MOVES = {**MOVES, **PROBES}


def _sparse(tuned, seed, m, density, rule, move=None):
    """A sparse cell at parity.py's ``tuned`` (``parity.selection()``) Streaming DiLoCo settings for M = m."""
    s = tuned[("stream", m)]
    return (parity.stream_overrides(seed, parity.LONG, m, 2, s, "stream2") + [f"diloco.density={density}"] + RULES[rule](s)
            + _ALL_MOVES.get(move, []) + ["diloco.average_over=replicas"])  # as they ran: the default then


def tune_cells():
    tuned = parity.selection()
    out = {f"sp_m2_{d}_{rule}_s0": ("tune", _sparse(tuned, 0, 2, density, rule))
           for d, density in DENSITIES.items() for rule in RULES}
    first = list(quality.register(out))
    if all(quality.finished(n) for n in first):  # the second round: from the best first-round cell
        d, rule, _ = _parts(min(first, key=quality.final))
        for move in MOVES:
            out[f"sp_m2_{d}_{rule}_{move}_s0"] = ("tune", _sparse(tuned, 0, 2, DENSITIES[d], rule, move))
    return out


def _from_chosen(group, m, variants):
    """Seed-0 cells at M = ``m`` from the chosen cell's density: ``variants(rule, move)`` gives the (rule,
    move) pairs to run."""
    best = chosen()
    if best is None:
        return {}
    d, rule, move = _parts(best)
    tuned = parity.selection()
    return {f"sp_m{m}_{_tag(d, r, mv)}_s0": (group, _sparse(tuned, 0, m, DENSITIES[d], r, mv))
            for r, mv in variants(rule, move)}


def probe_cells():
    """The late moves, from the chosen cell's density and rule (seed 0, M = 2)."""
    return _from_chosen("probe", 2, lambda rule, _: [(rule, mv) for mv in PROBES])


def tune4_cells():
    """Seed 0, M = 4: both outer rules at the chosen cell's density and move (run after the seeds: they show
    whether seed 0 picks at M = 4 the rule seeds 1-3 rank first there, not a choice that renames cells)."""
    return _from_chosen("tune4", 4, lambda _, move: [(r, move) for r in RULES])


def chosen():
    """The seed-0 tune cell with the lowest final eval loss, or None until every tune cell has finished."""
    names = list(tune_cells())
    if not all(quality.finished(n) for n in names):
        return None
    return min(names, key=quality.final)


def _parts(name):
    """(density key, rule, move or None) of a sparse cell's name."""
    parts = name.split("_")
    d, rule = parts[2], parts[3]
    move = parts[4] if len(parts) > 5 and parts[4] in _ALL_MOVES else None
    return d, rule, move


def _tag(d, rule, move):
    """The density/rule/move part of a sparse cell's name (``_parts``' inverse)."""
    return "_".join(x for x in (d, rule, move) if x)


def seeded_cells():
    out = {}
    best = chosen()
    if best is None:
        return out
    d, rule, move = _parts(best)
    tag = _tag(d, rule, move)
    tuned = parity.selection()
    for seed in parity.SEEDS:
        for m in (2, 4):
            out[f"sp_m{m}_{tag}_3000_s{seed}"] = ("final", _sparse(tuned, seed, m, DENSITIES[d], rule, move))
        out[f"muon_dp_3000_s{seed}"] = ("muon", parity.dp_overrides(seed, parity.LONG, tuned["dp"]) + MUON)
        out[f"muon_m2_stream4rot_3000_s{seed}"] = (
            "muon", parity.stream_overrides(seed, parity.LONG, 2, 4, tuned[("stream", 2)], "stream4rot") + MUON)
        out[f"muon_sp_m2_{tag}_3000_s{seed}"] = ("muon", _sparse(tuned, seed, 2, DENSITIES[d], rule, move) + MUON)
    # the second text (benchmarks/second_text.py), seed 1: data parallel and the chosen sparse cell, M = 2
    text2 = [f"data.path={os.path.relpath(second_text.OUT, common.ROOT)}"]
    out["kjv_dp_3000_s1"] = ("text2", parity.dp_overrides(1, parity.LONG, tuned["dp"]) + text2)
    out[f"kjv_sp_m2_{tag}_3000_s1"] = ("text2", _sparse(tuned, 1, 2, DENSITIES[d], rule, move) + text2)
    out.update(grid_cells(tuned, (d, rule), move))
    return out


def grid_cells(tuned, chosen_pair, move):
    """Seeds 1-3, M = 2 and 4: every other density x rule with the chosen move, beside the chosen cell
    (``chosen_pair``, in the ``final`` group; M = 2 first: it is the figure of merit's setting)."""
    return {f"sp_m{m}_{_tag(d, rule, move)}_3000_s{seed}": ("grid", _sparse(tuned, seed, m, density, rule, move))
            for m in (2, 4) for seed in parity.SEEDS for d, density in DENSITIES.items() for rule in RULES
            if (d, rule) != chosen_pair}


# Issue 41, the outer step tuned for the sparse rule (seed 0, 3 % density, SparseLoCo's rule: outer momentum 0,
# the accumulator decayed by 0.95): outer lr x the sparse mean's divisor (diloco.average_over), M = 2 first.
OUTER_LRS = (1, 2, 3, 4, 6)
AVERAGES = ("replicas", "senders")


# run first, at each M: the seed-0 probe (over replicas, lr 2), then the divisor it points to
OUTER_ORDER = [("replicas", 2), ("senders", 1), ("senders", 2), ("replicas", 3), ("replicas", 4), ("senders", 3),
               ("replicas", 6), ("senders", 4), ("senders", 6), ("replicas", 1)]


def outer_name(m, avg, lr):
    """The cell of M = m, divisor ``avg``, outer lr ``lr``: at M = 2, lr 1 over replicas is the tune cell
    ``sp_m2_d3_ef_s0`` (the same run), not run again."""
    return "sp_m2_d3_ef_s0" if (m, avg, lr) == (2, "replicas", 1) else f"sp41_m{m}_{avg}_lr{lr:g}_s0"


# The seed-0 references, run again: the archived data-parallel and dense cells (2026-12-01/02) predate
# cf4d0aa (2026-12-03), which made the replicated init the compiled one (a third of the initial values
# round differently), so every later run, the sparse ones included, starts from other bits than they did.
# Same seed, config and data order: these are their runs on today's init (parity.py's configs, unchanged).
REFS = {"sp41_ref_dp_s0": "par_dp_lr0.002_s0", "sp41_ref_m2_dense4_s0": "par_m2_stream4_momentum0.8_alpha0_lr0.005_s0",
        "sp41_ref_m4_dense4_s0": "par_m4_stream4_alpha0_lr0.005_s0"}


def outer_cells():
    tuned = parity.selection()
    sweep = {outer_name(m, avg, lr): ("outer", _sparse(tuned, 0, m, DENSITIES["d3"], "ef")
                                      + [f"diloco.outer_lr={lr}", f"diloco.average_over={avg}"])
             for m in (2, 4) for avg, lr in OUTER_ORDER if outer_name(m, avg, lr).startswith("sp41")}
    refs = {name: ("outer", list(parity.TUNE[old][1])) for name, old in REFS.items()}
    names = list(sweep)
    # the current cell, then the M = 2 references, then the rest of M = 2, the M = 4 reference, M = 4
    order = names[:4] + list(REFS)[:2] + names[4:9] + list(REFS)[2:] + names[9:]
    return {n: dict(sweep, **refs)[n] for n in order}


def senders_cell(seed, m, *extra, density="d3"):
    """SparseLoCo's rule with the mean over senders at outer lr 1 (the outer sweep's best at both M) at
    ``density``, seed ``seed``, plus ``extra`` overrides."""
    return _sparse(parity.selection(), seed, m, {**DENSITIES, **DENSITIES41}[density], "ef") + [
        "diloco.outer_lr=1", "diloco.average_over=senders", *extra]


# 1.5 % (issue 41's bits target): 61 of 4,096 entries at 2-bit uniform values, 112 bytes a chunk, 0.219 bits per
# value: 32 x 30 / 0.219 = 4,384x fewer bits than fp32 data parallel at H = 30 by the formula, 4,213x as compiled
# (each slice padded to whole chunks; 3 %: 2,145x; 1 %: 6,128x).
DENSITIES41 = {"d1.5": 0.015}


# Seed 0, around the outer sweep's best cell (senders, lr 1), at each M: the accumulator's decay, alpha 0.5,
# and 1 % density (the bits target) at lr 1 and 2, and at decay 0.99 (at 1 % an entry waits about 100 rounds
# to be sent, and decay 0.95 leaks what waits: 0.95^20 = 0.36; refuted: 0.99 lost more), then at lr 2 with
# decay 0.9 (the other way: forget stale mass sooner).
TUNE41 = {"decay0.9": ("d3", ["diloco.error_decay=0.9"]), "decay0.99": ("d3", ["diloco.error_decay=0.99"]),
          "alpha0.5": ("d3", ["diloco.alpha=0.5"]), "d1": ("d1", []), "d1_lr2": ("d1", ["diloco.outer_lr=2"]),
          "d1_decay0.99": ("d1", ["diloco.error_decay=0.99"]), "d1.5": ("d1.5", []),
          "d1_lr2_decay0.9": ("d1", ["diloco.outer_lr=2", "diloco.error_decay=0.9"]),
          "d1_lr2_decay0.8": ("d1", ["diloco.outer_lr=2", "diloco.error_decay=0.8"]),  # 0.9 helped at 1 %: further
          "d1.5_decay0.9": ("d1.5", ["diloco.error_decay=0.9"]),
          "d1.5_lr2_decay0.9": ("d1.5", ["diloco.outer_lr=2", "diloco.error_decay=0.9"]),  # lr 1 lags below 3 %
          # Nesterov momentum 0.5 at lr 0.5 (the same long-run step as lr 1 alone): does the dense reference's
          # outer momentum explain the sparse runs' give-back while the learning rate decays?
          "mom0.5": ("d3", ["diloco.outer_lr=0.5", "diloco.outer_momentum=0.5"]),
          # the other cheap test of the give-back: the outer step shrinks with the inner learning rate (the
          # same cosine to min_lr_ratio over each fragment's rounds), so the late rounds' noisy means and the
          # stale mass the accumulator still sends are applied smaller
          "cos": ("d3", ["diloco.outer_lr_decay=true"]),
          "d1.5_lr2_decay0.9_cos": ("d1.5", ["diloco.outer_lr=2", "diloco.error_decay=0.9",
                                             "diloco.outer_lr_decay=true"])}


# Seed 0, the senders' cell with SparseLoCo's values quantizer (sparse.binmean_quantize; statistics per
# 4,096-entry chunk until the chunks follow the leaves) in place of the 2-bit uniform one.
QUANT41 = {"binmean": ("d3", ["diloco.format=binmean"]), "d1_binmean": ("d1", ["diloco.format=binmean"])}
# Seed 0, the senders' cell with chunks that follow the leaves (64 x 64 tiles, 64-pieces, k scaled), with the
# 2-bit uniform values and with SparseLoCo's quantizer.
TILES41 = {"leaves": ("d3", ["diloco.chunks=leaves"]),
           "leaves_binmean": ("d3", ["diloco.chunks=leaves", "diloco.format=binmean"])}


# Seed 0, the senders' cell in the paper's topology (one fragment, no overlap, alpha 0) at H = 15 and 30: a
# diagnostic row, not a headline (the headline protocol stays 3 fragments, overlap 1, H = 30).
TOPO41 = {f"topo_h{h}": ("d3", ["diloco.num_fragments=1", "diloco.overlap=0", "diloco.alpha=0.0",
                                f"diloco.sync_every={h}"]) for h in (15, 30)}


def tune41_cells():
    return {f"sp41_m{m}_senders_lr1_{tag}_s0": (group, senders_cell(0, m, *extra, density=d))
            for group, table in (("tune41", TUNE41), ("quant41", QUANT41), ("topo41", TOPO41), ("tiles41", TILES41))
            for m in (2, 4) for tag, (d, extra) in table.items()}


def refs41_cells():
    """Seeds 1-3: parity.py's data-parallel and dense 4-bit rotated references (``par_dp_3000_s*``,
    ``par_m{2,4}_stream4rot_3000_s*``, archived before cf4d0aa) run again on today's init, then the senders'
    cell at 3 % at M = 2 and 4, so that every gap of the seeded table is paired to the bit."""
    out, archived = {}, parity.cells()
    for seed in parity.SEEDS:
        out[f"sp41_ref_dp_s{seed}"] = ("refs41", list(archived[f"par_dp_3000_s{seed}"][1]))
        for m in (2, 4):
            out[f"sp41_ref_m{m}_dense4rot_s{seed}"] = ("refs41", list(archived[f"par_m{m}_stream4rot_3000_s{seed}"][1]))
    for seed in parity.SEEDS:
        for m in (2, 4):
            out[f"sp41_m{m}_senders_lr1_s{seed}"] = ("refs41", senders_cell(seed, m))
    return out


SEEDS41 = ("d1.5_lr2_decay0.9", "d1_lr2_decay0.9", "decay0.9")


def seeds41_cells():
    """Seeds 1-3, M = 2: the seed-0 cells that reached a target's bound there (1.5 % and 1 % at lr 2 and decay
    0.9: the bits target and the 1 % target; 3 % at decay 0.9, the best seed-0 cell at 3 %), paired with
    ``refs41``'s references."""
    return {f"sp41_m2_senders_lr1_{tag}_s{seed}": ("seeds41", senders_cell(seed, 2, *TUNE41[tag][1],
                                                                          density=TUNE41[tag][0]))
            for tag in SEEDS41 for seed in parity.SEEDS}


def text41_cells():
    """The second text (benchmarks/second_text.py; never tuned on), seeds 1-2, M = 2: data parallel and the
    dense 4-bit rotated exchange on today's init (``kjv_dp_3000_s1`` predates cf4d0aa), the senders' cell
    (configs/sparse_diloco.py) and the 1.5 % cell at lr 2, decay 0.9 (the best on Shakespeare's seeds 1-3)."""
    tuned, text2 = parity.selection(), [f"data.path={os.path.relpath(second_text.OUT, common.ROOT)}"]
    out = {}
    for seed in (1, 2):
        out[f"kjv41_ref_dp_s{seed}"] = ("text41", parity.dp_overrides(seed, parity.LONG, tuned["dp"]) + text2)
        out[f"kjv41_m2_senders_lr1_s{seed}"] = ("text41", senders_cell(seed, 2) + text2)
        # the seeds41 cell that did best on Shakespeare's seeds 1-3 (1.5 % at lr 2, decay 0.9), never run here
        tag = "d1.5_lr2_decay0.9"
        out[f"kjv41_m2_senders_lr1_{tag}_s{seed}"] = ("text41", senders_cell(seed, 2, *TUNE41[tag][1],
                                                                             density=TUNE41[tag][0]) + text2)
    for seed in (1, 2):
        out[f"kjv41_ref_m2_dense4rot_s{seed}"] = ("text41", parity.stream_overrides(
            seed, parity.LONG, 2, 4, tuned[("stream", 2)], "stream4rot") + text2)
    return out


def refs41_table():
    """Seeds 1-3 on today's init: the references against their archived runs, and the senders' cell's paired
    gaps to them; then seed 0's tune41 and quant41 cells against the seed-0 references."""
    seeds = parity.SEEDS
    value = lambda n: f"{quality.final(n):.4f}" if quality.finished(n) else "-"
    lines = ["| reference (seed) | archived (before cf4d0aa) | today's init |", "|---|---:|---:|"]
    for seed in seeds:
        for ref, old in ((f"sp41_ref_dp_s{seed}", f"par_dp_3000_s{seed}"),
                         (f"sp41_ref_m2_dense4rot_s{seed}", f"par_m2_stream4rot_3000_s{seed}"),
                         (f"sp41_ref_m4_dense4rot_s{seed}", f"par_m4_stream4rot_3000_s{seed}")):
            lines.append(f"| `{old}` | {value(old)} | {value(ref)} |")
    lines += ["", "| cells (seeds 1-3), today's init | M | mean paired gap to data parallel | to dense 4-bit rotated, same M |",
              "|---|---:|---|---|"]
    for m in (2, 4):
        names = [f"sp41_m{m}_senders_lr1_s{seed}" for seed in seeds]
        dps = [f"sp41_ref_dp_s{seed}" for seed in seeds]
        dense = [f"sp41_ref_m{m}_dense4rot_s{seed}" for seed in seeds]
        lines.append(f"| `sp41_m{m}_senders_lr1_s*` (3 %, SparseLoCo's rule, mean over senders, lr 1) | {m} | "
                     f"{_paired(zip(names, dps))} | {_paired(zip(names, dense))} |")
        lines.append(f"| `sp41_ref_m{m}_dense4rot_s*` | {m} | {_paired(zip(dense, dps))} | |")
    lines += ["", "Seed 0 around the senders' cell (`tune41`, `quant41`; `topo41`: the paper's topology, a diagnostic); gaps to `sp41_ref_dp_s0` and to the dense "
              "4-bit reference at that M; bytes from each cell's compiled programs:", "",
              "| cell | M | final eval loss | gap to DP | gap to dense 4-bit | bytes per replica per step | fewer bits than fp32 DP |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for m in (2, 4):
        for tag in [""] + list(TUNE41) + list(QUANT41) + list(TOPO41) + list(TILES41):
            name = f"sp41_m{m}_senders_lr1_{tag + '_' if tag else ''}s0"
            b = parity.cross_replica_bytes(name) if quality.finished(name) else None
            lines.append(f"| `{name}` | {m} | {value(name)} | {parity.format_gap(_gap(name, 'sp41_ref_dp_s0'))} | "
                         f"{parity.format_gap(_gap(name, f'sp41_ref_m{m}_dense4_s0'))} | "
                         f"{common.human(b) if b else '-'} | {f'{parity.data_parallel_bytes(m) / b:,.0f}x' if b else '-'} |")
    return "\n".join(lines)


def seeds41_table():
    """Seeds 1-3, M = 2: each ``seeds41`` cell's paired gaps to data parallel and to dense 4-bit rotated (the
    ``refs41`` references), beside the senders' cell at 3 %, with its compiled bytes."""
    seeds = parity.SEEDS
    lines = ["| cell (seeds 1-3, M = 2) | finished | final eval loss per seed | mean paired gap to DP | to dense 4-bit rotated "
             "| fewer bits than fp32 DP |", "|---|---:|---|---|---|---:|"]
    for tag in ("",) + SEEDS41:
        names = [f"sp41_m2_senders_lr1_{tag + '_' if tag else ''}s{seed}" for seed in seeds]
        done = [n for n in names if quality.finished(n)]
        b = parity.cross_replica_bytes(done[0]) if done else None
        losses = ", ".join(f"{quality.final(n):.4f}" if quality.finished(n) else "-" for n in names)
        lines.append(f"| `{names[0][:-1]}*` | {len(done)}/3 | {losses} | "
                     f"{_paired(zip(names, [f'sp41_ref_dp_s{s}' for s in seeds]))} | "
                     f"{_paired(zip(names, [f'sp41_ref_m2_dense4rot_s{s}' for s in seeds]))} | "
                     f"{f'{parity.data_parallel_bytes(2) / b:,.0f}x' if b else '-'} |")
    return "\n".join(lines)


def text41_table():
    """The second text, seeds 1-2, M = 2: each cell's final eval loss and the senders' cell's paired gaps."""
    value = lambda n: f"{quality.final(n):.4f}" if quality.finished(n) else "-"
    lines = ["| seed | data parallel | dense 4-bit rotated | senders' cell (3 %) | senders vs DP | senders vs dense 4-bit "
             "| 1.5 %, lr 2, decay 0.9 | 1.5 % vs DP |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for seed in (1, 2):
        dp, dense, sp = f"kjv41_ref_dp_s{seed}", f"kjv41_ref_m2_dense4rot_s{seed}", f"kjv41_m2_senders_lr1_s{seed}"
        low = f"kjv41_m2_senders_lr1_d1.5_lr2_decay0.9_s{seed}"
        lines.append(f"| {seed} | {value(dp)} | {value(dense)} | {value(sp)} | {parity.format_gap(_gap(sp, dp))} | "
                     f"{parity.format_gap(_gap(sp, dense))} | {value(low)} | {parity.format_gap(_gap(low, dp))} |")
    return "\n".join(lines)


def outer_table():
    """Seed 0: final eval loss of each outer lr x divisor cell, and its gap to data parallel and to the tuned
    dense 4-bit exchange at the same M."""
    same = lambda ref, old: ref if quality.finished(ref) else old  # today's init where its run has finished
    dp = same("sp41_ref_dp_s0", DP_S0)
    lines = [f"Seed 0, {parity.LONG:,} steps, 3 % density, 2-bit values, SparseLoCo's rule (outer momentum 0, "
             f"accumulator decay 0.95) at each outer lr, the sparse mean over the M replicas or over the senders; "
             f"gaps to data parallel (`{dp}`) and to the tuned dense 4-bit exchange at that M (the `sp41_ref_` cells: "
             f"the archived references run again on today's init).", "",
             "| M | mean over | " + " | ".join(f"lr {lr:g}" for lr in OUTER_LRS) + " |",
             "|---|---|" + "---:|" * len(OUTER_LRS)]
    for m in (2, 4):
        dense = same(f"sp41_ref_m{m}_dense4_s0", REFS[f"sp41_ref_m{m}_dense4_s0"])
        for avg in AVERAGES:
            row = []
            for lr in OUTER_LRS:
                name = outer_name(m, avg, lr)
                if not quality.finished(name):
                    row.append("-")
                    continue
                row.append(f"{quality.final(name):.4f} ({parity.format_gap(_gap(name, dp))} DP, "
                           f"{parity.format_gap(_gap(name, dense))} dense)")
            lines.append(f"| {m} | {avg} | " + " | ".join(row) + " |")
    lines += ["", "| reference | archived (before cf4d0aa) | today's init |", "|---|---:|---:|"]
    for ref, old in REFS.items():
        value = f"{quality.final(ref):.4f}" if quality.finished(ref) else "-"
        lines.append(f"| `{old}` | {quality.final(old):.4f} | {value} |")
    return "\n".join(lines)


def cells():
    parity.cells()  # registers the references
    quality.register(outer_cells())
    tune = quality.register(tune_cells())
    probe = quality.register(probe_cells())
    return dict(tune, **probe, **quality.register(tune4_cells()), **quality.register(seeded_cells()),
                **outer_cells(), **quality.register(tune41_cells()), **quality.register(refs41_cells()),
                **quality.register(text41_cells()), **quality.register(seeds41_cells()))


def _loss(name):
    return f"{quality.final(name):.4f}" if quality.finished(name) else "running or queued"


def _gap(name, ref):
    if not (quality.finished(name) and quality.finished(ref)):
        return None
    return 100 * (quality.final(name) / quality.final(ref) - 1)


DP_S0 = "par_dp_lr0.002_s0"  # data parallel at its chosen lr, seed 0
SEED0_HEADER = ["| cell | density | outer rule | final eval loss | gap to DP | gap to dense 4-bit |",
                "|---|---:|---|---:|---:|---:|"]


def _seed0_row(name, dense, mark=""):
    """A seed-0 cell's row: its settings, final eval loss and gaps to data parallel and to ``dense``."""
    d, rule, move = _parts(name)
    rule = rule + (f", {move}" if move else "")
    return (f"| `{name}`{mark} | {100 * DENSITIES[d]:g} % | {rule} | {_loss(name)} | "
            f"{parity.format_gap(_gap(name, DP_S0))} | {parity.format_gap(_gap(name, dense)) if dense else ''} |")


def tune_table():
    dense = "par_m2_stream4_momentum0.8_alpha0_lr0.005_s0"
    lines = [f"Seed 0, M = 2, {parity.LONG:,} steps; gap to data parallel at its chosen lr (`{DP_S0}`) and to the "
             f"tuned dense 4-bit exchange (`{dense}`, the int exchange it was tuned with).", ""] + SEED0_HEADER
    best = chosen()
    probes = probe_cells()
    for name in list(tune_cells()) + list(probes):
        mark = " (chosen)" if name == best else " (probe, after the seeds ran)" if name in probes else ""
        lines.append(_seed0_row(name, dense, mark))
    return "\n".join(lines)


def tune4_table():
    dense = parity.best_tune_cell("par_m4_stream4")
    lines = [f"Seed 0, M = 4, {parity.LONG:,} steps (run after seeds 1-3); gap to data parallel (`{DP_S0}`) and to "
             f"the tuned dense 4-bit exchange at M = 4 (`{dense}`).", ""] + SEED0_HEADER
    lines += [_seed0_row(name, dense) for name in tune4_cells()]
    return "\n".join(lines)


def _paired(names_refs):
    """Mean signed gap (%) over the seeds whose pair has finished, its sd, and each seed's gap."""
    gaps = [g for g in (_gap(n, r) for n, r in names_refs) if g is not None]
    if not gaps:
        return "not run"
    sd = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
    return (f"{statistics.mean(gaps):+.2f} % (n = {len(gaps)}, sd {sd:.2f}; " + ", ".join(f"{g:+.2f}" for g in gaps)
            + ")")


def final_table():
    best = chosen()
    if best is None:
        return "The seeded cells wait for the tune cells."
    d, rule, move = _parts(best)
    tag = _tag(d, rule, move)
    seeds = parity.SEEDS
    rows = ["| cells (seeds 1-3) | M | bytes per replica per step (HLO) | fewer bits than fp32 data parallel | "
            "mean paired gap to data parallel (per seed) | to dense 4-bit rotated, same M |",
            "|---|---:|---:|---:|---|---|"]
    others = [_tag(g, r, move) for g in DENSITIES for r in RULES if _tag(g, r, move) != tag]
    for m in (2, 4):
        sparse = [f"sp_m{m}_{t}_3000" for t in [tag] + others]
        for prefix in sparse + [f"par_m{m}_stream4rot_3000", f"par_m{m}_stream2_3000"]:
            names = [f"{prefix}_s{s}" for s in seeds]
            done = [n for n in names if quality.finished(n)]
            if not done:
                continue
            b = parity.cross_replica_bytes(done[0])  # the same programs on every seed
            rows.append(f"| `{prefix}_s*` | {m} | {common.human(b)} | {parity.data_parallel_bytes(m) / b:,.0f}x | "
                        f"{_paired(zip(names, [f'par_dp_3000_s{s}' for s in seeds]))} | "
                        f"{_paired(zip(names, [f'par_m{m}_stream4rot_3000_s{s}' for s in seeds]))} |")
    for prefix, m in (("muon_dp", 1), ("muon_m2_stream4rot", 2), (f"muon_sp_m2_{tag}", 2)):
        names = [f"{prefix}_3000_s{s}" for s in seeds]
        rows.append(f"| `{prefix}_3000_s*` | {m} | | | {_paired(zip(names, [f'par_dp_3000_s{s}' for s in seeds]))} "
                    f"(to Muon data parallel: {_paired(zip(names, [f'muon_dp_3000_s{s}' for s in seeds]))}) | |")
    rows += ["", f"Second text (King James Bible, `benchmarks/second_text.py`), seed 1, M = 2: `kjv_sp_m2_{tag}_3000_s1` "
             f"{_loss(f'kjv_sp_m2_{tag}_3000_s1')} against data parallel's {_loss('kjv_dp_3000_s1')}: "
             f"{parity.format_gap(_gap(f'kjv_sp_m2_{tag}_3000_s1', 'kjv_dp_3000_s1'))}."]
    return "\n".join(rows)


def report(no_write, extra_args):
    cells()
    body = "\n\n".join([
        __doc__.split("\n\n", 1)[1].strip(),
        "Each cell's command: `python benchmarks/sparse_parity.py --list`.",
        "### Tuning on seed 0", tune_table(),
        "### Seed 0 at M = 4", tune4_table(),
        f"### Seeds 1-3 at {parity.LONG:,} steps", final_table(),
        "### The outer step for the sparse rule: outer lr x the mean's divisor (issue 41, seed 0)", outer_table(),
        "### The senders' cell on seeds 1-3, paired to the bit on today's init (issue 41)", refs41_table(),
        "### Seeds 1-3 of the seed-0 cells at a target's bound (issue 41, `seeds41`)", seeds41_table(),
        "### The senders' cell on the second text, seeds 1-2 (issue 41; never tuned on)", text41_table(),
    ])
    common.report(HEADING, body, no_write=no_write, extra_args=extra_args)


def main(argv=None):
    groups = ("tune", "final", "muon", "text2", "grid", "probe", "tune4", "outer", "tune41", "refs41", "quant41", "topo41",
              "tiles41", "text41", "seeds41")
    quality.cli(__doc__, groups, cells(), report, argv)


if __name__ == "__main__":
    main()
