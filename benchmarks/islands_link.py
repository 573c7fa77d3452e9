"""The islands' transfer path on this machine: seconds per exchange of a payload through JAX's transfer server.

    python benchmarks/islands_link.py            # 2 islands, payloads of 1, 16 and 64 MiB, 5 rounds each
    python benchmarks/islands_link.py --no-write

Two processes (no ``jax.distributed`` job between them), each an island of one CPU device
(``loco_jax.islands.Peers``), exchange one ``uint8`` payload per round: each offers its own and pulls its
peer's. Per payload size, after one warm-up round, the median over the rounds of: the whole exchange (offer,
pull, wait) and the host's share of it (the time ``offer`` and ``pull`` take to return: what the island's
dispatch thread gives up; the rest of the exchange runs beside its steps). Loopback, no ``tc`` limit: the
cost of the path itself, not of a slow link.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/
from benchmarks import common  # noqa: E402

HEADING = "## The islands' transfer path (benchmarks/islands_link.py)"
SIZES_MIB = (1, 16, 64)
ROUNDS = 5

WORKER = r'''
import json, sys, time
import numpy as np
import jax, jax.numpy as jnp
from loco_jax import islands
index, addresses, out, sizes, rounds = (int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3],
                                        [int(s) for s in sys.argv[4].split(",")], int(sys.argv[5]))
peers = islands.Peers(index, addresses, fingerprint={"benchmark": "islands_link"})
peers.handshake(timeout=120)
rows = []
for n in sizes:
    mine = jax.device_put(np.full(n, index, np.uint8))
    like = jax.ShapeDtypeStruct((n,), jnp.uint8)
    for r in range(rounds + 1):
        round_ = len(rows) + 1000 * n  # distinct per size and round
        start = time.perf_counter()
        peers.offer(round_, mine)
        pending = peers.pull(round_, like)
        host = time.perf_counter() - start
        got = pending.wait(300)
        total = time.perf_counter() - start
        assert int(np.asarray(got[1 - index])[0]) == 1 - index
        if r:  # the first round of a size warms the path up
            rows.append({"bytes": n, "host": host, "total": total})
json.dump(rows, open(out, "w"))
'''


def measure(sizes=SIZES_MIB, rounds=ROUNDS):
    """``{bytes: (median total s, median host s)}`` of island 0."""
    from tests.helpers import free_port

    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        addresses = ",".join(f"127.0.0.1:{free_port()}" for _ in range(2))
        sizes_bytes = ",".join(str(s << 20) for s in sizes)
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=common.ROOT)
        env.pop("XLA_FLAGS", None)
        procs = [subprocess.Popen([sys.executable, script, str(i), addresses, os.path.join(tmp, f"out{i}.json"),
                                   sizes_bytes, str(rounds)], cwd=common.ROOT, env=env) for i in range(2)]
        if any(p.wait(timeout=1800) for p in procs):
            raise SystemExit("an island failed; see its output above")
        rows = json.load(open(os.path.join(tmp, "out0.json")))
    out = {}
    for n in sorted({r["bytes"] for r in rows}):
        mine = [r for r in rows if r["bytes"] == n]
        out[n] = (statistics.median(r["total"] for r in mine), statistics.median(r["host"] for r in mine))
    return out


def table(results):
    lines = ["| payload | exchange (median) | host's share (median) | payload / exchange |", "|---:|---:|---:|---:|"]
    for n, (total, host) in results.items():
        lines.append(f"| {n / 2**20:g} MiB | {total * 1e3:.1f} ms | {host * 1e3:.2f} ms | "
                     f"{n * 8 / total / 1e9:.2f} Gbit/s |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/results.md alone")
    args = parser.parse_args(argv)
    body = "\n\n".join([__doc__.split("\n\n", 2)[2].strip(), table(measure())])
    common.report(HEADING, body, no_write=args.no_write, extra_args=argv or sys.argv[1:])


if __name__ == "__main__":
    main()
