"""Training quality on Shakespeare: LoCo and (Streaming) DiLoCo against full precision, side by side.

    python benchmarks/quality.py                    # every cell not yet run, then the tables and plots
    python benchmarks/quality.py --group loco       # one group: loco, diloco_m2, diloco_m4, sweep
    python benchmarks/quality.py --cell loco4_s1    # one cell
    python benchmarks/quality.py --list             # the cells and their train.py command lines
    python benchmarks/quality.py --report           # tables and plots from the finished cells only

Each cell is one ``train.py`` run (a subprocess, so a killed cell resumes from
its checkpoint) of the same small byte-level model, 480 steps of 16 x 64
tokens on 8 simulated CPU devices; the runs live in ``runs/quality/CELL`` (ignored by
git), and a finished cell's record (its eval rows, config and compiled
programs' byte counts, no checkpoints) is kept in ``benchmarks/results/CELL``
(tracked), so reports and the cells a selection depends on outlive the run
directory.
Every cell sees the same data order and evaluates on the same held-out
windows, so differences between cells are paired, and the three seeds (model
initialisation and data order) of the full-precision and 4-bit cells give the
spread a difference must beat.

Groups:
  loco       8-way data parallel: exact fp32 mean vs naive low-bit (no
             compensation) vs plain error feedback (beta 0) vs LoCo (beta
             0.8), at 4, 2 and 1 bits.
  diloco_m2  M = 2 replicas x 4 devices, H = 24 (20 outer rounds): DiLoCo
             fp32 (P = 1, tau = 0) and Streaming DiLoCo (P = 3, tau = 1,
             alpha 0.5) with fp32, 4-bit int and e3m0, 2-bit and 1-bit outer
             exchange, each without and with error compensation. Data
             parallel with equal tokens and inner steps is the loco group's
             fp32 cell (the same global batch on the same 8 devices).
  diloco_m4  the same with M = 4 replicas x 2 devices.
  sweep      Streaming DiLoCo 4-bit at M = 2: H, overlap tau 0-5, alpha 0 / 0.5 / 1, block size.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/
from benchmarks import common  # noqa: E402

HEADING = "## Training quality (benchmarks/quality.py)"
RUNS = os.path.join(common.ROOT, "runs", "quality")
ARCHIVE = os.path.join(common.ROOT, "benchmarks", "results")  # finished cells' records, tracked by git
ARCHIVED_FILES = ("config.json", "programs.json")
IMG = os.path.join(common.ROOT, "docs", "img")
STEPS, H = 480, 24

BASE = [
    f"steps={STEPS}", "batch_size=16", "seq_len=64", "eval_every=48", "eval_batches=16", "log_every=8",
    "checkpoint_every=240", "keep_checkpoints=1",
    "optim.lr=0.003",  # pinned: configs/ddp.py, the base file, runs its own tuned rate (2e-3 at 3,000 steps)
]
SEEDS = (0, 1, 2)


def _seed(s):
    # This matrix measures LoCo's and the paper's reference settings (int absmax / e3m0 payloads); the
    # measured per-bit defaults are benchmarks/lowbit.py's.
    return [f"seed={s}", f"data.seed={s}", "loco.preset=reference", "diloco.preset=reference"]


def _stream(m, bits=None, fmt="int", comp=False, *, fragments=3, overlap=1, alpha=0.5, h=H, block=256):
    return _seed(0) + [
        f"mesh.replicas={m}", "diloco.enabled=true", f"diloco.sync_every={h}", f"diloco.num_fragments={fragments}",
        f"diloco.overlap={overlap}", f"diloco.alpha={alpha}", f"diloco.bits={bits}", f"diloco.format={fmt}",
        f"diloco.compensate={str(comp).lower()}", f"diloco.block_size={block}",
    ]


def cells() -> dict[str, tuple[str, list[str]]]:
    """name -> (group, --set overrides on top of BASE)."""
    out = {}
    for s in SEEDS:
        out[f"fp32_s{s}"] = ("loco", _seed(s))
        out[f"loco4_s{s}"] = ("loco", _seed(s) + ["loco.bits=4"])
    for b in (4, 2, 1):
        out[f"naive{b}"] = ("loco", _seed(0) + [f"loco.bits={b}", "loco.compensate=false"])
        out[f"ef{b}"] = ("loco", _seed(0) + [f"loco.bits={b}", "loco.beta=0"])
        if b != 4:
            out[f"loco{b}"] = ("loco", _seed(0) + [f"loco.bits={b}"])
    for m in (2, 4):
        g = f"diloco_m{m}"
        out[f"m{m}_diloco_fp32"] = (g, _stream(m, fragments=1, overlap=0, alpha=0.0))
        out[f"m{m}_stream_fp32"] = (g, _stream(m))
        for bits, fmt in ((4, "int"), (4, "e3m0"), (2, "int"), (1, "int")):
            for comp in (False, True):
                name = f"m{m}_stream_{fmt}{bits}" + ("_comp" if comp else "")
                out[name] = (g, _stream(m, bits, fmt, comp))
    for h in (12, 48):
        out[f"sweep_H{h}"] = ("sweep", _stream(2, 4, h=h))
    for tau in (0, 2, 3, 4, 5):
        out[f"sweep_tau{tau}"] = ("sweep", _stream(2, 4, overlap=tau))
    for alpha in (0.0, 1.0):
        out[f"sweep_alpha{alpha:g}"] = ("sweep", _stream(2, 4, alpha=alpha))
    for block in (64, 1024):
        out[f"sweep_block{block}"] = ("sweep", _stream(2, 4, block=block))
    return register(out)


OVERRIDES = {}  # cell name -> its overrides, filled by the scripts that define cells (see register)


def register(table):
    """Makes ``table``'s cells (name -> (group, overrides)) known to the helpers below; returns it."""
    for name, (_, overrides) in table.items():
        OVERRIDES[name] = overrides
    return table


def resolved_key(overrides) -> str:
    """8 hex digits of the fully resolved config (library defaults for None settings filled in), so a
    cell's result under one set of defaults is never read back under another."""
    return _resolved_key(tuple(overrides))


@functools.lru_cache(maxsize=None)
def _resolved_key(overrides) -> str:  # the reports ask for every cell's directory many times
    from loco_jax.training.run import config as config_lib

    cfg = config_lib.resolve(config_lib.load(os.path.join(common.ROOT, "configs", "ddp.py"), BASE + list(overrides)))
    d = config_lib.to_dict(cfg)
    if d["diloco"]["density"] is None:  # a dense exchange: the sparse mean's divisor and chunks mean nothing
        d["diloco"].pop("average_over")
        d["diloco"].pop("chunks")
    for dotted, value in _UNKEYED.items():  # fields that leave the training numbers as they were
        *parents, leaf = dotted.split(".")
        node = functools.reduce(lambda n, k: n[k], parents, d)
        if value is _ANY or node.get(leaf) == value:
            node.pop(leaf, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]


_ANY = object()
# Config fields added after cells were run, at the values that reproduce those runs, and fields that only
# shape the output: left out of the key, so adding them does not orphan finished cells.
_UNKEYED = {"sample_tokens": _ANY, "data.sp_model": None, "data.require_path": None,
            "model.attention": _ANY,  # how the step computes, not what it trains (XLA's on every CPU cell)
            "loco.in_backward": False,  # LoCo after the backward pass, as every cell ran it
            "micro_batch": None,  # accum_steps as given
            # the model's own fields, in the config since issue 29, at the values every cell ran with
            "model.rope_theta": 10000.0, "model.norm_eps": 1e-5, "model.param_dtype": "float32",
            "model.init_std": 0.02,
            # the sparse exchange and the inner optimizer's choice (issue 30), off / AdamW before
            "diloco.density": None, "diloco.chunk": 4096, "diloco.error_decay": None, "optim.name": "adamw",
            "optim.muon_beta": 0.95,
            "diloco.keep_unsent": False,  # each replica restarting from the global parameters, as before
            # a sparse mean over the M replicas, as before issue 41 (its sparse cells name it since the default
            # became "senders"; a dense cell's is dropped above)
            "diloco.average_over": "replicas",
            "diloco.chunks": "flat",  # chunks of the flat fragment, as before (issue 41)
            "diloco.outer_lr_decay": False}  # a constant outer learning rate, as before (issue 41)


def cell_dir(name, overrides=None) -> str:
    """``runs/quality/NAME-KEY`` relative to the repo root (KEY: :func:`resolved_key`)."""
    overrides = OVERRIDES[name] if overrides is None else overrides
    return os.path.join("runs", "quality", f"{name}-{resolved_key(overrides)}")


def argv_of(name, overrides):
    sets = []
    for kv in BASE + overrides:
        sets += ["--set", kv]
    return ["train.py", "--config", "configs/ddp.py", "--workdir", cell_dir(name, overrides)] + sets


def steps_of(name) -> int:
    """The cell's run length: the last ``steps=`` of BASE and its overrides (480 unless a cell sets one)."""
    return int([kv for kv in BASE + OVERRIDES[name] if kv.startswith("steps=")][-1].split("=", 1)[1])


def _finishes(rows, name) -> bool:
    """Whether metrics ``rows`` hold the cell's final eval (its last step)."""
    return any(r.get("step") == steps_of(name) and "eval_loss" in r for r in rows)


def finished(name) -> bool:
    return _finishes(_metrics(name), name)


def archive_dir(name) -> str:
    """``benchmarks/results/NAME-KEY``: the tracked record of a finished cell."""
    return os.path.join(ARCHIVE, os.path.basename(cell_dir(name)))


def cell_file(name, filename) -> str:
    """A cell's file: from its run directory while that exists, else from its archived record."""
    path = os.path.join(common.ROOT, cell_dir(name), filename)
    return path if os.path.exists(path) else os.path.join(archive_dir(name), filename)


def _metrics(name):
    from loco_jax.training.run.metrics import read_metrics  # rows cut short by a kill are skipped

    rows = read_metrics(os.path.join(common.ROOT, cell_dir(name)))
    if _finishes(rows, name):
        return rows
    return read_metrics(archive_dir(name)) or rows  # a record outlives an unfinished rerun's directory


def archive(name) -> bool:
    """Copies a finished cell's record to :func:`archive_dir`: the metrics rows that carry an eval or fall
    on a multiple of 100 steps (plus the last), its config.json and programs.json. False if not finished."""
    from loco_jax.training.run.metrics import read_metrics

    workdir = os.path.join(common.ROOT, cell_dir(name))
    rows = read_metrics(workdir)
    if not _finishes(rows, name):
        return False
    out = archive_dir(name)
    os.makedirs(out, exist_ok=True)
    kept = [r for i, r in enumerate(rows) if "eval_loss" in r or r["step"] % 100 == 0 or i == len(rows) - 1]
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    for filename in ARCHIVED_FILES:
        if os.path.exists(os.path.join(workdir, filename)):
            shutil.copyfile(os.path.join(workdir, filename), os.path.join(out, filename))
    return True


def run_cell(name, overrides, index, total):
    if finished(name):
        print(f"[{index}/{total}] {name}: done already", flush=True)
        return
    workdir = os.path.join(common.ROOT, cell_dir(name, overrides))
    os.makedirs(workdir, exist_ok=True)
    log_path = os.path.join(workdir, "train.log")
    start = time.perf_counter()
    print(f"[{index}/{total}] {name}: python {' '.join(argv_of(name, overrides))}", flush=True)
    with open(log_path, "a") as log:
        proc = subprocess.run([sys.executable] + argv_of(name, overrides), cwd=common.ROOT, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"cell {name} failed (exit {proc.returncode}); see {log_path}")
    archive(name)
    print(f"[{index}/{total}] {name}: eval loss {final(name):.4f} in {time.perf_counter() - start:.0f} s", flush=True)


def final(name):
    rows = [r for r in _metrics(name) if "eval_loss" in r and r["step"] == steps_of(name)]
    return rows[-1]["eval_loss"] if rows else float("nan")


def evals(name):
    return [(r["step"], r["eval_loss"]) for r in _metrics(name) if "eval_loss" in r]


# ---------------------------------------------------------------------------------------------- report


def _mean_sd(names):
    vals = [final(n) for n in names if finished(n)]
    if not vals:
        return float("nan"), float("nan"), 0
    return statistics.mean(vals), (statistics.stdev(vals) if len(vals) > 1 else float("nan")), len(vals)


def _gap(value, ref):
    return f"{100 * (value / ref - 1):+.2f} %"


def _fmt(name):
    return f"{final(name):.4f}" if finished(name) else "not run"


def loco_table():
    fp_mean, fp_sd, fp_n = _mean_sd([f"fp32_s{s}" for s in SEEDS])
    l4_mean, l4_sd, l4_n = _mean_sd([f"loco4_s{s}" for s in SEEDS])
    ref = final("fp32_s0")
    lines = [
        "### LoCo: 8-way data parallel (AdamW), final eval loss (nats per byte) at step 480",
        "",
        f"Full precision over {fp_n} seeds: {fp_mean:.4f} +/- {fp_sd:.4f} (mean +/- sd); LoCo 4-bit over {l4_n} "
        f"seeds: {l4_mean:.4f} +/- {l4_sd:.4f}. The single-seed cells below use seed 0, and their gaps are to "
        f"full precision with seed 0 ({ref:.4f}), the same initialisation and data order.",
        "",
        "| bits | naive (no compensation) | error feedback (beta 0) | LoCo (beta 0.8) |",
        "|---:|---:|---:|---:|",
    ]
    for b in (4, 2, 1):
        loco_name = "loco4_s0" if b == 4 else f"loco{b}"
        row = [f"| {b} "]
        for n in (f"naive{b}", f"ef{b}", loco_name):
            row.append(f"{_fmt(n)} ({_gap(final(n), ref)})" if finished(n) else "not run")
        lines.append(" | ".join(row) + " |")
    if fp_n and l4_n:
        gap = 100 * (l4_mean / fp_mean - 1)
        paired = [100 * (final(f"loco4_s{s}") / final(f"fp32_s{s}") - 1) for s in SEEDS
                  if finished(f"loco4_s{s}") and finished(f"fp32_s{s}")]
        verdict = "meets" if gap <= 0.3 and paired and max(paired) <= 0.5 else "misses"
        lines += [
            "",
            f"LoCo 4-bit (reference settings) vs full precision, seed means: {gap:+.2f} %; paired gaps "
            + ", ".join(f"{p:+.2f} %" for p in paired)
            + f". The target (issue 11) is a mean gap <= +0.3 % with no seed above +0.5 %: the reference "
            f"settings {verdict} it (the measured defaults are in the low-bit section).",
        ]
    return "\n".join(lines)


def diloco_table(m):
    dp = final("fp32_s0")
    base = final(f"m{m}_diloco_fp32")
    lines = [
        f"### DiLoCo: M = {m} replicas x {8 // m} devices, H = {H}, {STEPS // H} outer rounds, final eval loss on the global parameters",
        "",
        f"Gaps are to DiLoCo fp32 ({base:.4f}); data parallel with equal tokens and inner steps (the LoCo "
        f"group's full-precision seed 0) reaches {dp:.4f}, so DiLoCo fp32 is {_gap(base, dp)} from it.",
        "",
        "| method | outer exchange | no compensation | with compensation |",
        "|---|---|---:|---:|",
        f"| DiLoCo (P = 1, tau = 0) | fp32 | {_fmt(f'm{m}_diloco_fp32')} | |",
        f"| Streaming (P = 3, tau = 1, alpha 0.5) | fp32 | {_fmt(f'm{m}_stream_fp32')} ({_gap(final(f'm{m}_stream_fp32'), base)}) | |",
    ]
    for bits, fmt in ((4, "int"), (4, "e3m0"), (2, "int"), (1, "int")):
        n = f"m{m}_stream_{fmt}{bits}"
        cols = [f"{_fmt(x)} ({_gap(final(x), base)})" if finished(x) else "not run" for x in (n, n + "_comp")]
        lines.append(f"| Streaming | {bits}-bit {fmt} | {cols[0]} | {cols[1]} |")
    return "\n".join(lines)


def sweep_table():
    base = "m2_stream_int4"
    ref = final(base)
    rows = [("H (sync_every)", [("12", "sweep_H12"), ("24", base), ("48", "sweep_H48")]),
            ("overlap tau", [(str(t), base if t == 1 else f"sweep_tau{t}") for t in range(6)]),
            ("alpha", [("0", "sweep_alpha0"), ("0.5", base), ("1", "sweep_alpha1")]),
            ("block size", [("64", "sweep_block64"), ("256", base), ("1024", "sweep_block1024")])]
    lines = [
        f"### Sweeps: Streaming DiLoCo, 4-bit int outer exchange, M = 2, P = 3 (default H = {H}, tau = 1, alpha 0.5, block 256)",
        "",
        f"Final eval loss, and its gap to the default setting ({ref:.4f}).",
        "",
        "| setting | values |",
        "|---|---|",
    ]
    for what, values in rows:
        cells_ = [f"{v}: {_fmt(n)}" + (f" ({_gap(final(n), ref)})" if finished(n) and n != base else "") for v, n in values]
        lines.append(f"| {what} | " + "; ".join(cells_) + " |")
    return "\n".join(lines)


def plots():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(IMG, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for ax, b in zip(axes, (4, 2, 1)):
        for n, label, style in (("fp32_s0", "fp32", "k-"), (f"naive{b}", "naive", "r--"), (f"ef{b}", "EF (beta 0)", "b-."),
                                ("loco4_s0" if b == 4 else f"loco{b}", "LoCo", "g-")):
            if evals(n):
                ax.plot(*zip(*evals(n)), style, marker="o", ms=3, label=label)
        ax.set_title(f"{b}-bit gradient all-reduce, 8 devices")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("eval loss (nats/byte)")
    fig.tight_layout()
    loco_png = os.path.join(IMG, "quality_loco.png")
    fig.savefig(loco_png, dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), sharey=True)
    for ax, m in zip(axes, (2, 4)):
        for n, label in (("fp32_s0", "data parallel"), (f"m{m}_diloco_fp32", "DiLoCo fp32"),
                         (f"m{m}_stream_fp32", "Streaming fp32"), (f"m{m}_stream_int4", "Streaming 4-bit"),
                         (f"m{m}_stream_int2_comp", "Streaming 2-bit + comp"), (f"m{m}_stream_int1", "Streaming 1-bit"),
                         (f"m{m}_stream_int1_comp", "Streaming 1-bit + comp")):
            if evals(n):
                ax.plot(*zip(*evals(n)), marker="o", ms=3, label=label)
        ax.set_title(f"M = {m} replicas, H = {H}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("eval loss on global params (nats/byte)")
    fig.tight_layout()
    diloco_png = os.path.join(IMG, "quality_diloco.png")
    fig.savefig(diloco_png, dpi=100)
    plt.close(fig)
    return loco_png, diloco_png


def report(no_write, extra_args):
    loco_png, diloco_png = plots()
    rel = lambda p: os.path.relpath(p, os.path.dirname(common.RESULTS))
    body = "\n\n".join([
        "Model: 4 layers, d_model 128, 4 heads, SwiGLU 384, 919k parameters, bytes as tokens; AdamW lr 3e-3 "
        "(20 warm-up steps, cosine to 10 %), clip 1.0; 480 steps of 16 sequences x 64 tokens (492k tokens); "
        "eval on 16 x 16 held-out windows of 64 tokens. Each cell's command line: `python benchmarks/quality.py --list`.",
        loco_table(), f"![LoCo eval loss]({rel(loco_png)})",
        diloco_table(2), diloco_table(4), f"![DiLoCo eval loss]({rel(diloco_png)})", sweep_table(),
    ])
    common.report(HEADING, body, no_write=no_write, extra_args=extra_args)


def cli(doc, groups, table, report_fn, argv=None, on_finish=None):
    """The command line shared by the cell benchmarks: --group/--cell to run, --list, --report, --no-write,
    --archive; ``on_finish(name)`` runs after each cell this call runs or finds finished."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", choices=groups, action="append")
    ap.add_argument("--cell", action="append")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--report", action="store_true", help="only write the tables and plots")
    ap.add_argument("--no-write", action="store_true", help="print the tables; leave docs/ alone")
    ap.add_argument("--archive", action="store_true", help="only copy the finished cells' records to benchmarks/results/")
    args = ap.parse_args(argv)
    if args.archive:
        done = [name for name in table if archive(name)]
        print(f"archived {len(done)} finished cell(s) to {os.path.relpath(ARCHIVE, common.ROOT)}: {', '.join(done)}")
        return
    if args.list:
        for name, (group, overrides) in table.items():
            print(f"{name} [{group}]{' (done)' if finished(name) else ''}: python {' '.join(argv_of(name, overrides))}")
        return
    if not args.report:
        unknown = set(args.cell or ()) - set(table)
        if unknown:
            raise SystemExit(f"unknown cell(s) {sorted(unknown)}; see --list")
        chosen = [n for n, (g, _) in table.items()
                  if (not args.group and not args.cell) or (args.group and g in args.group) or (args.cell and n in args.cell)]
        for i, name in enumerate(chosen, 1):
            run_cell(name, table[name][1], i, len(chosen))
            if on_finish:
                on_finish(name)
    report_fn(args.no_write, [a for a in sys.argv[1:] if a != "--no-write"])


def main():
    cli(__doc__, ("loco", "diloco_m2", "diloco_m4", "sweep"), cells(), report)


if __name__ == "__main__":
    main()
