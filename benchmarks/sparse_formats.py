"""Which value format a sparse payload should use: the relative error of each chunk's kept entries.

    python benchmarks/sparse_formats.py [--no-write]

For 64 chunks of 4,096 values (Gaussian, and Gaussian times a log-normal for heavier tails, as outer
gradients have), each chunk keeps its k largest entries (``loco_jax.sparse``) and quantizes them as one
block; the table gives ``||DQ(Q(v)) - v|| / ||v||`` over the kept values ``v``. The kept values all lie far
from zero, so a grid with a zero level (``int`` at 2 bits: -1, 0, +1 times the block's absmax) wastes it.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/
from benchmarks import common  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from loco_jax import diloco, sparse  # noqa: E402

HEADING = "## Sparse payloads: the kept values' format (benchmarks/sparse_formats.py)"
CELLS = [(b, f) for b, formats in ((2, ("int", "uniform", "lloyd")), (4, ("int", "uniform", "lloyd")),
                                   (1, ("int",))) for f in formats]


def kept_error(x, cfg):
    positions, values, _ = cfg.select(x)
    exact = cfg._scatter(positions, values).reshape(-1)
    return float(jnp.linalg.norm(cfg.encode(x)[1] - exact) / jnp.linalg.norm(exact))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    n = 4096 * 64
    gauss = jax.random.normal(jax.random.key(0), (n,))
    heavy = gauss * jnp.exp(jax.random.normal(jax.random.key(1), (n,)))
    lines = [__doc__.split("\n\n", 2)[2].strip(), "",
             "| bits | format | bits per value (64 of 4,096) | Gaussian, 64 kept | heavy-tailed, 64 kept | "
             "Gaussian, 123 kept (3 %) | heavy-tailed, 123 kept |", "|---:|---|---:|---:|---:|---:|---:|"]
    for bits, fmt in CELLS:
        row = []
        for k in (64, 123):
            cfg = sparse.sparse_config(k / 4096, bits=bits, format=fmt)
            row += [kept_error(gauss, cfg), kept_error(heavy, cfg)]
        mark = " (default)" if diloco.SPARSE_FORMATS[bits] == fmt else ""
        bpv = sparse.sparse_config(64 / 4096, bits=bits, format=fmt).bits_per_value()
        lines.append(f"| {bits} | {fmt}{mark} | {bpv:.3f} | " + " | ".join(f"{e:.3f}" for e in row) + " |")
    common.report(HEADING, "\n".join(lines), no_write=args.no_write, extra_args=sys.argv[1:])


if __name__ == "__main__":
    main()
