"""Bytes on the wire per replica for data parallel, DiLoCo and Streaming DiLoCo, from compiled HLO.

For a model's abstract parameter tree (nothing allocated), every distinct
phase program of a training step is lowered and compiled on a (replica, data)
mesh of simulated CPU devices; ``hlo.collective_bytes`` reads the bytes of
each collective, and the ones whose groups span the ``replica`` axis are
summed over the D devices of a replica ("bytes per replica": what crosses
the slow links). Averaging the phases over one period of H steps gives the
bytes per step; the heaviest phase gives the peak.

    python benchmarks/bandwidth.py                       # the 1B shapes, H = 100, P = 9
    python benchmarks/bandwidth.py --model tiny --no-write

Data parallel is the hierarchical exact all-reduce (reduce-scatter over
``data``, all-reduce of the 1/D shard over ``replica``, all-gather over
``data``): 2 (M-1)/M of the gradient crosses per replica per step. The inner
optimizer is SGD (it moves no bytes); gradients are program inputs, so no
model is compiled.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/
from benchmarks import common  # noqa: E402  (sets XLA_FLAGS before jax is imported)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from loco_jax import collectives, diloco, exchange, fragments, hlo  # noqa: E402
from loco_jax.training import shapes  # noqa: E402

HEADING = "## Bandwidth per replica: data parallel vs DiLoCo vs Streaming DiLoCo (benchmarks/bandwidth.py)"
MODELS = {
    "1b": lambda: shapes.llama_1b_shapes(),
    "125m": lambda: shapes.transformer_shapes(num_layers=12, d_model=768, num_heads=12, d_ff=2048, vocab_size=32000),
    "tiny": lambda: shapes.transformer_shapes(num_layers=4, d_model=128, num_heads=4, d_ff=512, vocab_size=256),
}


# The sparse exchange's densities (exchange.Sparse.of(density, ...), 4,096-entry chunks, 12-bit positions): 3 % and
# 1 % (the quality cells of benchmarks/parity.py) and 64 of 4,096 (1.56 %, the bytes target).
SPARSE_DENSITIES = (0.03, 64 / 4096, 0.01)


def global_view(shapes, mesh, spec, m):
    """Abstract global arrays: per-replica blocks concatenated on dim 0."""
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((s.shape[0] * m,) + s.shape[1:], s.dtype, sharding=NamedSharding(mesh, spec)),
        shapes,
    )


def replica_bytes(compiled, m, d):
    """Bytes that cross ``replica`` per replica: ops whose groups span replicas, times D devices."""
    report = hlo.collective_bytes(compiled)
    ops = [op for op in report.ops if op.spans(d)]
    return sum(op.total_bytes for op in ops) * d, sorted({op.dtype for op in ops})


def data_parallel(shapes, mesh, dtype):
    """Every step: exact hierarchical all-reduce of the gradient in ``dtype``."""

    def step(grads):
        def one(g):
            flat = g.astype(dtype).reshape(-1)
            d = lax.axis_size("data")
            flat = jnp.pad(flat, (0, -flat.shape[0] % d))
            shard = lax.psum_scatter(flat, "data", tiled=True)
            shard = lax.psum(shard, "replica")
            return lax.all_gather(shard, "data", tiled=True)[: g.size].reshape(g.shape).astype(g.dtype)

        return jax.tree.map(one, grads)

    spec = P(("replica", "data"))
    grads = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((s.shape[0] * 8,) + s.shape[1:], s.dtype, sharding=NamedSharding(mesh, spec)),
        shapes,
    )
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec,), out_specs=spec))
    return f.lower(grads).compile()


def data_parallel_loco(shapes, mesh, bits):
    """Every step: LoCo's quantized all-reduce over ``replica`` on each device's 1/D shard (hierarchical form).

    The same payload ``loco.compress`` sends, with the exact reduce-scatter and all-gather over ``data``.
    """

    def step(grads):
        return collectives.quantized_pmean(grads, "replica", bits=bits, fast_axis="data")

    spec = P(("replica", "data"))
    grads = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((s.shape[0] * 8,) + s.shape[1:], s.dtype, sharding=NamedSharding(mesh, spec)),
        shapes,
    )
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec,), out_specs=spec, check_vma=False)).lower(grads).compile()


def diloco_programs(shapes, mesh, **kwargs):
    """Compiled step program of every distinct phase: {phase: compiled}."""
    m = mesh.shape["replica"]
    tx = diloco.diloco(optax.sgd(0.1), **kwargs)
    params = global_view(shapes, mesh, P("replica"), m)
    specs = diloco.state_specs(tx, params, mesh)
    state = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P("replica"), out_specs=specs), params)
    state = jax.tree.map(lambda s, sp: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, sp)), state, specs)
    out = {}
    for ph in tx.phases():

        def step(grads, state, params, ph=ph):
            updates, state = tx.update(grads, state, params, phase=ph)
            return optax.apply_updates(params, updates), state

        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("replica"), specs, P("replica")), out_specs=(P("replica"), specs)))
        out[ph] = f.lower(params, state, params).compile()
    return tx, out


def measure(model, mesh, m, d, h, p):
    """Rows (name, payload dtypes, avg bytes/step, peak bytes/step, bytes per H steps) for one model."""
    shapes = MODELS[model]()
    rows = []
    for name, dtype in (("data parallel fp32", jnp.float32), ("data parallel bf16", jnp.bfloat16)):
        b, dtypes = replica_bytes(data_parallel(shapes, mesh, dtype), m, d)
        rows.append((name, dtypes, b, b, b * h))
    for bits in (8, 4, 2, 1):
        b, dtypes = replica_bytes(data_parallel_loco(shapes, mesh, bits), m, d)
        rows.append((f"data parallel LoCo {bits}-bit", dtypes, b, b, b * h))
    variants = [
        ("DiLoCo fp32 (P=1)", dict(num_fragments=1, overlap=0)),
        (f"Streaming DiLoCo fp32 (P={p}, tau=1)", dict(num_fragments=p, overlap=1)),
        (f"Streaming DiLoCo 4-bit (P={p}, tau=1)", dict(num_fragments=p, overlap=1, bits=4)),
        (f"Streaming DiLoCo 4-bit e3m0 (P={p}, tau=1)", dict(num_fragments=p, overlap=1, bits=diloco.codec(4, format="e3m0"))),
        (f"Streaming DiLoCo 2-bit (P={p}, tau=1)", dict(num_fragments=p, overlap=1, bits=2)),
        (f"Streaming DiLoCo 4-bit two-stage (P={p}, tau=1)", dict(num_fragments=p, overlap=1, bits=4, mode="two_stage")),
    ] + [(f"Streaming DiLoCo sparse {100 * density:.3g} % 2-bit (P={p}, tau=1)",
          dict(num_fragments=p, overlap=1, bits=exchange.Sparse.of(density, bits=2))) for density in SPARSE_DENSITIES]
    for name, kw in variants:
        t0 = time.time()
        tx, programs = diloco_programs(shapes, mesh, sync_every=h, **kw)
        per_phase = {ph: replica_bytes(c, m, d) for ph, c in programs.items()}
        per_step = [per_phase[tx.phase(t)][0] for t in range(h + 1, 2 * h + 1)]  # one period in steady state
        dtypes = sorted({x for _, dt in per_phase.values() for x in dt})
        rows.append((name, dtypes, sum(per_step) / h, max(per_step), sum(per_step)))
        print(f"  {model} {name}: {common.human(sum(per_step))} per {h} steps, peak {common.human(max(per_step))} "
              f"({len(programs)} programs, {time.time() - t0:.0f} s)", flush=True)
    return fragments.count_params(shapes), rows


def table(model, n, rows, m, d, h, p, run_steps):
    fp32 = rows[0][4]
    bf16_wire = fp32 / 2  # a bf16 all-reduce's bytes where the backend does not widen it (GPU)
    (_, bf16_dtypes, _, _, bf16_total), rows = rows[1], [rows[0]] + rows[2:]
    lines = [
        f"### `{model}`: {n:,} parameters",
        "",
        f"M = {m} replicas x D = {d} data devices, H = {h}, P = {p}; a run of {run_steps:,} steps.",
        "",
        "| variant | payload in HLO | avg bytes / step | peak bytes / step | per H steps | whole run | fewer bits than bf16 DP | than fp32 DP |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, dtypes, avg, peak, total in rows:
        lines.append(
            f"| {name} | {', '.join(dtypes)} | {common.human(avg)} | {common.human(peak)} | {common.human(total)} | "
            f"{common.human(avg * run_steps)} | {bf16_wire / total:,.1f}x | {fp32 / total:,.1f}x |"
        )
    lines += [
        "",
        f"bf16 data parallel compiles to a `{', '.join(bf16_dtypes)}` all-reduce on the CPU backend "
        f"({common.human(bf16_total)} per H steps, no saving), so the bf16 column uses half the fp32 bytes.",
        "",
    ]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "125m", "1b"])
    parser.add_argument("--sync-every", type=int, default=100)
    parser.add_argument("--fragments", type=int, default=9)
    parser.add_argument("--run-steps", type=int, default=88_000, help="steps of a whole run (diloco_1b: 88,000)")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--heading", default=HEADING, help="the results section to write (one per H)")
    args = parser.parse_args()

    mesh = jax.make_mesh((2, 4), ("replica", "data"))
    m, d, h, p = 2, 4, args.sync_every, args.fragments
    lines = [
        "Bytes per replica = bytes of the collectives whose groups span `replica`, summed over the replica's D "
        "devices, read from the compiled HLO of every program (every DiLoCo phase; a period of H steps in steady "
        "state). Data parallel is the hierarchical all-reduce (exact reduce-scatter over `data`, all-reduce of the "
        "1/D shard over `replica`, all-gather over `data`); its LoCo rows send LoCo's two-stage quantized payload "
        "over `replica`. XLA's CPU backend widens bf16 all-reduces to f32, so the bf16 baseline is half the fp32 "
        "bytes, what a bf16 all-reduce puts on the wire where it is not widened (GPU). At M = 2 the all-gather and "
        "two-stage forms move the same bytes; for M > 2 the all-gather form grows as (M-1) against 2(M-1)/M, so the "
        "reduction factors hold for the two-stage form at any M and for the all-gather form at M = 2.",
        "",
    ]
    for model in args.models:
        layers = len(MODELS[model]()["layers"])
        p_model = min(p, layers + 1)  # every fragment needs a block: at most one per block, plus fragment 0
        n, rows = measure(model, mesh, m, d, h, p_model)
        lines += table(model, n, rows, m, d, h, p_model, args.run_steps)
    common.report(args.heading, "\n".join(lines), no_write=args.no_write, extra_args=sys.argv[1:])


if __name__ == "__main__":
    main()
