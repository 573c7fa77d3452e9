"""Compression benchmark: wire bytes (from compiled HLO), all-reduce error and CPU time.

Runs on an 8-way ``("data",)`` mesh of simulated CPU devices, on a gradient tree
shaped like a small transformer, and writes its tables into ``docs/results.md``
(section "Compression: bytes, error and CPU time"), replacing only that section.

    python benchmarks/compression.py              # full run, a few minutes on 2 cores
    python benchmarks/compression.py --quick      # smaller tree, fewer repeats (smoke check)
    python benchmarks/compression.py --no-write   # print only

1. Bytes per device per step, read from the compiled HLO of a whole step
   (``jit(shard_map(...))``: per-device gradients in, ``tx.update`` and an SGD
   update applied) for the exact fp32 mean, a bf16 psum and ``loco.compress``
   at 8/4/2/1 bits in both exchange forms, beside the ring formula of
   ``collectives.wire_bytes_per_device``.
2. Relative L2 error of one quantized all-reduce (``collectives.quantized_pmean``)
   of i.i.d. Gaussian per-device gradients against the exact fp32 mean.
3. CPU time per step of the compressed step against the exact-psum step,
   timed interleaved.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/
from benchmarks import common  # noqa: E402  (sets XLA_FLAGS before jax is imported)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from loco_jax import collectives, fragments, hlo, loco  # noqa: E402
from loco_jax.training import shapes as shapes_lib  # noqa: E402

M = 8
AXIS = "data"
HEADING = "## Compression: bytes, error and CPU time (benchmarks/compression.py)"
TARGET_4BIT = 0.14  # 4-bit two-stage bytes / fp32 bytes must not exceed this
FLAG_BYTES = 64  # collectives smaller than this are the finite-flag pmin, not payload
TREE = dict(num_layers=4, d_model=256, num_heads=4, d_ff=1024, vocab_size=8192)
QUICK_TREE = dict(num_layers=2, d_model=128, num_heads=4, d_ff=512, vocab_size=2048)


# --------------------------------------------------------------------------
# The gradient tree


def make_params(mesh, shapes):
    return jax.tree.map(lambda s: jax.device_put(jnp.zeros(s.shape, s.dtype), NamedSharding(mesh, P())), shapes)


def make_grads(mesh, shapes, seed):
    """i.i.d. N(0, 1) gradients, a different one on every device: global (8 * s0, ...) split on dim 0."""
    sharding = NamedSharding(mesh, P(AXIS))
    leaves, treedef = jax.tree.flatten(shapes)
    out = []
    for i, s in enumerate(leaves):
        shape = (M * s.shape[0],) + s.shape[1:]
        gen = jax.jit(lambda k, shape=shape, dtype=s.dtype: jax.random.normal(k, shape, dtype), out_shardings=sharding)
        out.append(jax.block_until_ready(gen(jax.random.fold_in(jax.random.PRNGKey(seed), i))))
    return jax.tree.unflatten(treedef, out)


# --------------------------------------------------------------------------
# The variants: every one is an optax transformation that averages over AXIS


def fp32_mean(g):
    """The exact fp32 mean over AXIS."""
    return lax.pmean(g.astype(jnp.float32), AXIS)


def bf16_mean(g):
    """Cast to bf16, psum, cast back to fp32 and divide by M."""
    return lax.psum(g.astype(jnp.bfloat16), AXIS).astype(jnp.float32) / M


def tree_mean(leaf_mean):
    """An optax transformation that averages every leaf with ``leaf_mean``."""

    def update(updates, state, params=None):
        return jax.tree.map(leaf_mean, updates), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def variants():
    """(name, kind, kwargs) for part 1; kind is "exact", "bf16" or "loco"."""
    out = [
        ("fp32 lax.pmean", "exact", {}),
        ("bf16 lax.psum", "bf16", {}),
        ("loco bits=None (fp32)", "loco", dict(bits=None)),
    ]
    for mode in ("two_stage", "all_gather"):  # LoCo's reference settings: int absmax payloads, beta 0.8
        for bits in (8, 4, 2, 1):
            out.append((f"loco {bits}-bit {mode}", "loco", dict(bits=bits, mode=mode, preset="reference")))
    out.append(("loco 4-bit e3m0 two_stage", "loco", dict(bits=4, format="e3m0", mode="two_stage", preset="reference")))
    for bits in (4, 2, 1):  # what loco.compress(bits=b) resolves to (loco.MEASURED)
        out.append((default_name(bits), "loco", dict(bits=bits, mode="two_stage")))
    return out


def default_name(bits):
    s = loco.settings(bits)
    what = f"{s['format']}{', rotated' if s['rotate'] else ''}{'' if s['compensate'] else ', naive'}"
    return f"loco {bits}-bit default ({what}) two_stage"


def make_tx(kind, kwargs):
    leaf_mean = {"exact": fp32_mean, "bf16": bf16_mean}.get(kind)
    if leaf_mean:
        return optax.chain(tree_mean(leaf_mean), optax.sgd(1e-3))
    settings = {k: v for k, v in kwargs.items() if k != "mode"}  # what is sent; the mode is how
    reduce_tx = loco.compress(loco.codec(**settings), axis_name=AXIS, mode=kwargs.get("mode", "two_stage"))
    return optax.chain(reduce_tx, optax.sgd(1e-3))


def compiled_init(mesh, tx, params, specs):
    """``tx.init`` under shard_map, compiled: (compiled, seconds to lower and compile)."""
    t0 = time.perf_counter()
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)).lower(params).compile()
    return init, time.perf_counter() - t0


class Step:
    """A compiled whole step: (params, state, per-device grads) -> (params, state)."""

    def __init__(self, mesh, tx, params, grads):
        specs = loco.state_specs(tx, params, mesh)

        def body(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        self.init_fn, self.init_compile_s = compiled_init(mesh, tx, params, specs)
        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs)))
        state = jax.block_until_ready(self.init_fn(params))
        t0 = time.perf_counter()
        lowered = step.lower(params, state, grads)
        # The all-reduces' element types before XLA's passes (the CPU backend widens bf16 ones).
        lowered_report = hlo.collective_bytes(lowered.as_text(dialect="hlo"))
        self.lowered_all_reduce_dtypes = sorted({d for op in lowered_report.filter(kind="all-reduce") for d in op.dtypes})
        self.compiled = lowered.compile()
        self.compile_s = time.perf_counter() - t0
        self.params0 = params

    def fresh(self):
        return self.params0, jax.block_until_ready(self.init_fn(self.params0))

    def __call__(self, params, state, grads):
        # One program at a time: XLA's CPU collectives can deadlock with several in flight.
        return jax.block_until_ready(self.compiled(params, state, grads))


# --------------------------------------------------------------------------
# Part 1: bytes from HLO


def hlo_summary(report):
    """(dtypes of the payload collectives, "kind xN" counts, payload bytes, flag bytes)."""
    payload = report.filter(min_bytes=FLAG_BYTES)
    flags = [op for op in report.ops if op not in payload]
    dtypes = sorted({d for op in payload for d in op.dtypes})
    kinds = collections.Counter()
    for op in report.ops:
        kinds[op.kind] += op.count
    counts = ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items()))
    return dtypes, counts, sum(op.total_bytes for op in payload), sum(op.total_bytes for op in flags), flags


def part_bytes(mesh, params, grads, n):
    rows, steps, notes = [], {}, []
    fp32_formula = collectives.wire_bytes_per_device(n, M, bits=None)
    fp32_total = None
    for name, kind, kwargs in variants():
        step = Step(mesh, make_tx(kind, kwargs), params, grads)
        steps[name] = step
        report = hlo.collective_bytes(step.compiled)
        dtypes, counts, payload, flag, flag_ops = hlo_summary(report)
        bits = kwargs.get("bits")
        mode = kwargs.get("mode", "two_stage")
        if kind == "bf16":
            formula = fp32_formula / 2  # what a bf16 ring all-reduce would move
            formula_note = "bf16 ideal"
        else:
            formula = collectives.wire_bytes_per_device(n, M, bits=bits, mode=mode)
            formula_note = ""
        if fp32_total is None:
            fp32_total = report.total
        if flag_ops:
            notes.append((name, tuple(sorted({op.dtype for op in flag_ops})), len(flag_ops), flag))
        agree = abs(payload - formula) <= 1e-9 * formula
        rows.append(
            dict(
                name=name,
                kind=kind,
                bits=bits,
                mode=mode,
                format=kwargs.get("format", "int"),
                dtypes=dtypes,
                pre_dtypes=step.lowered_all_reduce_dtypes,
                counts=counts,
                total=report.total,
                payload=payload,
                flag=flag,
                formula=formula,
                formula_note=formula_note,
                agree=agree,
                ratio=report.total / fp32_total,
                compile_s=step.compile_s,
                init_compile_s=step.init_compile_s,
                table=report.table(),
            )
        )
        print(
            f"  compiled {name:28s} step {step.compile_s:5.1f} s, init {step.init_compile_s:4.1f} s  "
            f"{common.human(report.total):>10s}/device",
            flush=True,
        )
    return rows, steps, notes


def bytes_table(rows):
    lines = [
        "| variant | payload dtype(s) in HLO | collectives (count by kind) | bytes/device (HLO) "
        "| formula `wire_bytes_per_device` | HLO payload = formula | ratio to fp32 |",
        "|---|---|---|---:|---:|:---:|---:|",
    ]
    for r in rows:
        formula = common.human(r["formula"]) + (f" ({r['formula_note']})" if r["formula_note"] else "")
        pre = f" (lowered all-reduce, before XLA's passes: {', '.join(r['pre_dtypes'])})" if r["kind"] == "bf16" else ""
        agree = "yes" if r["agree"] else ("no (see note)" if r["kind"] != "bf16" else "no: CPU widens")
        lines.append(
            f"| {r['name']} | {', '.join(r['dtypes'])}{pre} | {r['counts']} | {common.human(r['total'])} | {formula} "
            f"| {agree} | {r['ratio']:.4f} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Part 2: error of one quantized all-reduce


def rel_err_tree(got, want):
    num = den = 0.0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        num += float(np.sum((a - b) ** 2))
        den += float(np.sum(b**2))
    return (num / den) ** 0.5


def part_error(mesh, grads, params):
    def run(fn):
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AXIS), out_specs=P()))
        return jax.tree.map(np.asarray, jax.block_until_ready(f(grads)))

    exact = run(lambda g: jax.tree.map(fp32_mean, g))
    rows = []
    bf16 = run(lambda g: jax.tree.map(bf16_mean, g))
    rows.append(("bf16 lax.psum (reference)", rel_err_tree(bf16, exact)))
    configs = [(b, "int") for b in (8, 4, 2, 1)] + [(4, "e3m0")]
    for bits, fmt in configs:
        for mode in ("two_stage", "all_gather"):
            kw = dict(bits=bits, format=fmt, mode=mode)
            out = run(lambda g, kw=kw: collectives.quantized_pmean(g, AXIS, **kw))
            label = f"{bits}-bit {fmt} {mode}"
            rows.append((label, rel_err_tree(out, exact)))
            print(f"  error {label:24s} {rows[-1][1]:.4g}", flush=True)
            if bits == 4 and fmt == "int" and mode == "two_stage":
                qmean_4bit = out

    # loco.compress's first step equals quantized_pmean: its error buffer starts at zero.
    tx = loco.compress(bits=4, axis_name=AXIS)
    specs = loco.state_specs(tx, params, mesh)
    init, _ = compiled_init(mesh, tx, params, specs)
    upd = jax.jit(
        jax.shard_map(lambda g, s: tx.update(g, s)[0], mesh=mesh, in_specs=(P(AXIS), specs), out_specs=P())
    )
    state = jax.block_until_ready(init(params))
    first = jax.tree.map(np.asarray, jax.block_until_ready(upd(grads, state)))
    max_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(qmean_4bit)))
    scale = max(float(np.max(np.abs(b))) for b in jax.tree.leaves(qmean_4bit))
    return rows, max_diff, scale


def error_table(rows):
    lines = ["| all-reduce | relative L2 error vs exact fp32 mean |", "|---|---:|"]
    lines += [f"| {name} | {err:.4g} |" for name, err in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Part 3: CPU time, interleaved


def _run_steps(step, carry, grads, n_steps):
    params, state = carry
    t0 = time.perf_counter()
    for _ in range(n_steps):
        params, state = step(params, state, grads)
    return (time.perf_counter() - t0) / n_steps, (params, state)


def part_time(steps, grads, names, baseline, repeats, steps_per_run, warmup):
    rows = []
    for name in names:
        a, b = steps[baseline], steps[name]
        ca, cb = a.fresh(), b.fresh()
        _, ca = _run_steps(a, ca, grads, warmup)
        _, cb = _run_steps(b, cb, grads, warmup)
        ta, tb = [], []
        for _ in range(repeats):
            t, ca = _run_steps(a, ca, grads, steps_per_run)
            ta.append(t)
            t, cb = _run_steps(b, cb, grads, steps_per_run)
            tb.append(t)
        ma, mb = statistics.median(ta), statistics.median(tb)
        rows.append((name, ma, mb, mb / ma))
        print(f"  time {name:28s} exact {ma * 1e3:8.1f} ms  compressed {mb * 1e3:8.1f} ms  ratio {mb / ma:.2f}", flush=True)
    return rows


def time_table(rows, baseline):
    lines = [
        f"| compressed step | baseline: {baseline}, median ms/step | compressed, median ms/step "
        "| ratio compressed / baseline |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {ma * 1e3:.1f} | {mb * 1e3:.1f} | {ratio:.2f} |" for name, ma, mb, ratio in rows]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=None, help="timed runs of each step, interleaved (default 7; 3 with --quick)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/results.md alone")
    ap.add_argument("--quick", action="store_true", help="smaller tree and fewer repeats (a smoke check)")
    args = ap.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 7)
    steps_per_run = 2 if args.quick else 3
    warmup = 1 if args.quick else 2

    assert jax.device_count() == M, f"need {M} devices, got {jax.device_count()} (XLA_FLAGS={os.environ.get('XLA_FLAGS')})"
    mesh = jax.make_mesh((M,), (AXIS,))
    dims = QUICK_TREE if args.quick else TREE
    shapes = shapes_lib.transformer_shapes(**dims)
    n = fragments.count_params(shapes)
    d, f, v = dims["d_model"], dims["d_ff"], dims["vocab_size"]
    tree_desc = (
        f"`training.shapes.transformer_shapes({', '.join(f'{k}={x}' for k, x in dims.items())})`: embedding {v}x{d}, "
        f"{dims['num_layers']} blocks (wq, wk, wv, wo {d}x{d}; w_gate, w_up {d}x{f}; w_down {f}x{d}; two RMSNorm "
        f"scales), final norm, untied lm_head {d}x{v}: {n:,} parameters in {len(jax.tree.leaves(shapes))} leaves"
    )
    print(f"gradient tree: {tree_desc}", flush=True)
    started = common.start()
    t_start = started[0]

    params = make_params(mesh, shapes)
    grads = make_grads(mesh, shapes, seed=0)

    print("part 1: bytes from compiled HLO", flush=True)
    byte_rows, steps, flag_notes = part_bytes(mesh, params, grads, n)
    by_name = {r["name"]: r for r in byte_rows}
    mismatches = [r for r in byte_rows if r["kind"] != "bf16" and not r["agree"]]
    for r in mismatches:
        print(f"MISMATCH {r['name']}: HLO payload {r['payload']} B vs formula {r['formula']} B\n{r['table']}", flush=True)
    four = by_name["loco 4-bit two_stage"]
    assert four["ratio"] <= TARGET_4BIT, f"4-bit two-stage moves {four['ratio']:.4f} of fp32 > {TARGET_4BIT}"
    bf16_dtypes = by_name["bf16 lax.psum"]["dtypes"]
    bf16_ratio = by_name["bf16 lax.psum"]["ratio"]
    bf16_pre = by_name["bf16 lax.psum"]["pre_dtypes"]

    print(f"part 1 done at {time.perf_counter() - t_start:.0f} s", flush=True)
    print("part 2: error of one quantized all-reduce", flush=True)
    err_rows, first_diff, first_scale = part_error(mesh, grads, params)

    print(f"part 2 done at {time.perf_counter() - t_start:.0f} s", flush=True)
    print("part 3: CPU time", flush=True)
    timed = ["loco 4-bit two_stage", "loco 4-bit all_gather", "loco 1-bit two_stage"]
    time_rows = part_time(steps, grads, timed, "fp32 lax.pmean", repeats, steps_per_run, warmup)
    print("part 3b: the per-bit defaults against today's (reference) 4-bit step", flush=True)
    default_rows = part_time(steps, grads, [default_name(b) for b in (4, 2, 1)], "loco 4-bit two_stage", repeats,
                             steps_per_run, warmup)

    errs = dict(err_rows)
    ag4, ts4 = by_name["loco 4-bit all_gather"]["ratio"], four["ratio"]
    init_s = max(r["init_compile_s"] for r in byte_rows)
    out = [
        f"Gradient tree: {tree_desc}. Mesh: 8-way `(\"data\",)`; every device holds its own i.i.d. N(0, 1) "
        "gradient of that tree. Other processes on the machine slow the timed steps (see the load average "
        "above); the byte counts and errors do not depend on them.",
        "",
        "### Wire bytes per device per step (compiled HLO of the whole step)",
        "",
        "Each step is `jit(shard_map(...))`: per-device gradients in (`in_specs=P(\"data\")`), the variant's "
        "`update`, then `optax.sgd`. Bytes are read from the compiled HLO by `hlo.collective_bytes` (ring "
        "formulas per op, summed); the formula column is `collectives.wire_bytes_per_device(n, 8, bits, mode)` "
        "for the payload collectives. Default block 256 with fp32 scales, one bucket for the whole tree.",
        "",
        bytes_table(byte_rows),
        "",
        f"Target: 4-bit two-stage moves {ts4:.4f} of the fp32 bytes, <= {TARGET_4BIT} (asserted). "
        f"`tx.init` compiles in at most {init_s:.1f} s for any variant (its zero error buffers are built "
        "without quantizing a constant, `quant.stored_zeros`).",
    ]
    if flag_notes:
        kinds = sorted({(d, c, b) for _, d, c, b in flag_notes})
        what = "; ".join(f"{c} scalar {'/'.join(d)} all-reduce ({common.human(b)})" for d, c, b in kinds)
        out += [
            "",
            f"Besides its payload, each of the {len(flag_notes)} `loco.compress` steps holds {what}: the `pmin` of "
            "the finite flag that makes every device skip a non-finite step together. It is included in "
            "bytes/device and left out of the comparison with the formula.",
        ]
    if mismatches:
        out += ["", "**Formula and HLO disagree** for: " + ", ".join(r["name"] for r in mismatches)]
    out += [
        "",
        "### Relative L2 error of one quantized all-reduce",
        "",
        "`collectives.quantized_pmean` of the per-device gradients against the exact fp32 mean (`lax.pmean`); "
        "error norm over the whole tree divided by the exact mean's norm. `loco.compress`'s first step is this "
        "same all-reduce (its error buffer starts at zero): its 4-bit two-stage first update "
        + (
            "is bit-identical to `quantized_pmean`'s result (checked)."
            if first_diff == 0
            else f"differs from `quantized_pmean`'s by at most {first_diff:.3g} (largest value {first_scale:.3g})."
        ),
        "",
        error_table(err_rows),
        "",
        "### CPU time per step, compressed vs exact",
        "",
        f"Both steps compiled, {warmup} warm-up steps each, then {repeats} interleaved runs (A, B, A, B, ...) of "
        f"{steps_per_run} steps each, `block_until_ready` after every step; median seconds per step. On CPU "
        "the \"network\" is memory copies between simulated devices, so the ratio measures the compute "
        "overhead of quantizing, packing and decoding, not a network speed-up.",
        "",
        time_table(time_rows, "fp32 lax.pmean"),
        "",
        "The per-bit defaults of `loco.compress(bits=b)` (Hadamard rotation and RMS-fitted levels where "
        "`loco.MEASURED` says so) against today's reference 4-bit step (int absmax), timed the same way, "
        "side by side (target: at most 1.3x):",
        "",
        time_table(default_rows, "loco 4-bit two_stage (reference)"),
        "",
        "### Interpretation",
        "",
        "Payloads cross the wire as `uint8` and the HLO payload bytes match the ring formula for every LoCo "
        "variant" + (" except the ones flagged above" if mismatches else "")
        + f"; each value costs b + 32/256 bits (the fp32 block scale), so 4-bit two-stage is {ts4:.3f} of fp32 "
        f"rather than 0.125, and 1-bit {by_name['loco 1-bit two_stage']['ratio']:.3f} rather than 0.031. "
        f"The all-gather form sends every device's whole payload to every other device, (M-1) N values instead "
        f"of 2 (M-1)/M N, so at M = 8 it costs M/2 = 4 times the two-stage bytes ({ag4:.3f} of fp32 at 4 bits, "
        f"{by_name['loco 8-bit all_gather']['ratio']:.3f} at 8 bits, more than fp32) in exchange for one "
        f"quantization instead of two, which shows as a lower error ({errs['4-bit int all_gather']:.3g} "
        f"against {errs['4-bit int two_stage']:.3g} at 4 bits). "
        f"The bf16 psum is lowered as a {', '.join(bf16_pre)} `all_reduce` but the compiled CPU HLO holds "
        f"a {', '.join(bf16_dtypes)} all-reduce"
        + (
            f" (XLA's CPU backend promotes it), so here it moves as many bytes as fp32 (ratio {bf16_ratio:.2f}) "
            "and only adds rounding error; a backend that kept the bf16 all-reduce would move half."
            if "bf16" not in bf16_dtypes
            else f" (ratio {bf16_ratio:.2f} of fp32)."
        )
        + f" On i.i.d. Gaussian gradients the 2-bit symmetric grid (levels 0 and +-absmax) errs "
        f"{errs['2-bit int two_stage']:.3g}, "
        + ("more" if errs["2-bit int two_stage"] > errs["1-bit int two_stage"] else "less")
        + f" than 1-bit scaled sign ({errs['1-bit int two_stage']:.3g}), and 4-bit e3m0 errs "
        f"{errs['4-bit e3m0 two_stage']:.3g} against {errs['4-bit int two_stage']:.3g} for 4-bit int; "
        "these are single-step errors, before LoCo's error feedback compensates them over later steps. "
        f"On CPU the 4-bit two-stage step takes {time_rows[0][3]:.1f}x the exact step's time: with no slow "
        "link to save, only the encoding work shows.",
        "",
    ]
    body = "\n".join(out)
    print()
    print(body)
    if not args.no_write:
        common.write_section(HEADING, body, extra_args=sys.argv[1:] if argv is None else argv, script=__file__, started=started)
        print(f"wrote {os.path.relpath(common.RESULTS, os.getcwd())}")
    if mismatches:
        print("FAILED: formula and HLO bytes disagree for " + ", ".join(r["name"] for r in mismatches))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
