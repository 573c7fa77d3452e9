"""Steps per second when the network is the bottleneck: two processes, two network namespaces, a tc-limited link.

    python benchmarks/network.py                          # as root: set up, measure, tear down, write results
    python benchmarks/network.py --rates none,100mbit --methods dp,stream_tau0,stream_tau1 --no-write

Two "hosts" on one machine: network namespaces ``ljnet0`` and ``ljnet1``
joined by a veth pair (10.213.0.1 <-> 10.213.0.2). Each namespace gets an
``/etc/netns/NAME/hosts`` entry that maps this machine's hostname to its own
veth address, because gloo advertises whatever address the hostname resolves
to. One training process runs in each namespace (``jax.distributed`` with gloo
CPU collectives, one CPU device each), so every cross-process collective
crosses the veth link.

The link rate is set by each process on its own end (egress) with a ``tbf``
qdisc, between measurements, so one launch measures every rate with the same
compiled programs: no limit, 1 Gbit/s and 100 Mbit/s by default. ``netem`` is
missing from this kernel, so no latency is added.

Methods (the cross-process axis is ``data`` for data parallel, ``replica`` for DiLoCo):
  dp            data parallel, exact fp32 gradient all-reduce every step
  loco4         data parallel with LoCo 4-bit (two-stage quantized all-reduce)
  diloco        DiLoCo, H steps then one fp32 exchange of every parameter (P = 1, tau = 0)
  stream_tau0   Streaming DiLoCo, P = 3 fragments, fp32, overlap tau = 0
  stream_tau1   Streaming DiLoCo, P = 3, fp32, tau = 1 (the exchange runs in the next step's program)
  stream4_tau1  Streaming DiLoCo, P = 3, 4-bit outer exchange, tau = 1

The model is parameter-heavy and the batch small (one sequence per process)
so the link, not the two cores, is the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/

HEADING = "## Speed on a rate-limited link (benchmarks/network.py)"
NAMESPACES = ("ljnet0", "ljnet1")
VETH = ("ljv0", "ljv1")
ADDRS = ("10.213.0.1", "10.213.0.2")
PORT = 12731
H = 12
MODEL = ["model.d_model=512", "model.num_layers=2", "model.num_heads=8", "model.d_ff=1536", "model.compute_dtype=float32"]
BASE = ["batch_size=2", "seq_len=64"] + MODEL
_STREAM = ["mesh.replicas=2", "diloco.enabled=true", f"diloco.sync_every={H}", "diloco.num_fragments=3"]
METHODS = {
    "dp": ["mesh.replicas=1"],
    "loco4": ["mesh.replicas=1", "loco.bits=4"],
    "diloco": ["mesh.replicas=2", "diloco.enabled=true", f"diloco.sync_every={H}"],
    "stream_tau0": _STREAM,
    "stream_tau1": _STREAM + ["diloco.overlap=1", "diloco.alpha=0.5"],
    "stream4_tau1": _STREAM + ["diloco.overlap=1", "diloco.alpha=0.5", "diloco.bits=4"],
}
# tbf needs a bucket of at least rate / HZ bytes; these are generous for both rates.
TBF = {"1gbit": "burst 512kb latency 100ms", "100mbit": "burst 64kb latency 100ms"}


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


# ------------------------------------------------------------------------------------------- namespaces


def teardown():
    for ns in NAMESPACES:
        sh("ip", "netns", "del", ns, check=False)  # deletes its veth end, and with it the pair
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def setup():
    teardown()
    host = socket.gethostname()
    sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, dev, addr in zip(NAMESPACES, VETH, ADDRS):
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
        with open(f"/etc/netns/{ns}/hosts", "w") as f:  # gloo advertises what the hostname resolves to
            f.write(f"127.0.0.1 localhost\n{addr} {host}\n")


def set_rate(dev, rate, namespace=None):
    """Limits the egress of ``dev`` to ``rate`` ('none' removes the limit), in ``namespace`` or this one."""
    tc = ("ip", "netns", "exec", namespace, "tc") if namespace else ("tc",)
    sh(*tc, "qdisc", "del", "dev", dev, "root", check=False)
    if rate != "none":
        sh(*tc, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, *TBF.get(rate, "burst 64kb latency 100ms").split())


def link_throughput(rate, megabytes=8):
    """Mbit/s of one TCP stream from ljnet1 to ljnet0 at ``rate`` (checks what tbf gives)."""
    for ns, dev in zip(NAMESPACES, VETH):
        set_rate(dev, rate, ns)
    server = ("import socket,time;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
              f"s.bind(('{ADDRS[0]}',{PORT + 1}));s.listen(1);c,_=s.accept();n=0;t=None\n"
              "while True:\n b=c.recv(1<<20)\n if t is None: t=time.perf_counter()\n if not b: break\n n+=len(b)\n"
              "print(n*8/(time.perf_counter()-t)/1e6)")
    client = (f"import socket,time;time.sleep(0.5);s=socket.create_connection(('{ADDRS[0]}',{PORT + 1}));"
              f"s.sendall(b'x'*({megabytes}<<20));s.close()")
    srv = subprocess.Popen(["ip", "netns", "exec", NAMESPACES[0], sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
    sh("ip", "netns", "exec", NAMESPACES[1], sys.executable, "-c", client)
    out, _ = srv.communicate(timeout=120)
    return float(out.strip())


# ------------------------------------------------------------------------------------------- worker


def worker(args):
    """One process of the pair: for each method, compile, warm up, then time steps at each rate."""
    from loco_jax.training.run import mesh as mesh_lib

    mesh_lib.initialize(f"{ADDRS[0]}:{PORT}", 2, args.process_id, local_device_count=1)
    import jax
    from jax.experimental import multihost_utils

    from loco_jax.training.run import config as config_lib
    from loco_jax.training import model as model_lib
    from loco_jax.training.run.steps import TrainState
    from loco_jax.training.run.trainer import Trainer

    dev = VETH[args.process_id]
    results = {}
    for method in args.methods:
        cfg = config_lib.override(config_lib.Config(), BASE + METHODS[method])
        t = Trainer(cfg, workdir=None, log=lambda *_: None)
        state, batches, step = t.init_state(), t.dataset.train_iterator(seed=0), 0

        def run(n):
            nonlocal state, step
            times = []
            for _ in range(n):
                step += 1
                batch = t.put_batch(batches.next_batch(cfg.batch_size))
                start = time.perf_counter()
                params, opt, _ = t.program(t.phase(step), state, batch)(state.params, state.opt_state, *batch)
                state = TrainState(params, opt)
                jax.block_until_ready(state)
                times.append(time.perf_counter() - start)
            return times

        set_rate(dev, "none")
        multihost_utils.sync_global_devices(f"{method} warm-up")
        run(2 * H + 1 if cfg.diloco.enabled else 2)  # compiles every phase's program
        results[method] = {"params": model_lib.count_params(t.mcfg),
                           "bytes_per_step": {k: v["per_device"] for k, v in t.program_bytes.items()}}
        for rate in args.rates:
            set_rate(dev, rate)
            multihost_utils.sync_global_devices(f"{method} {rate}")
            first = step + 1
            times = run(args.periods * H)
            phases = [str(t.phase(s)) for s in range(first, step + 1)]
            results[method][rate] = {"step_times": times, "phases": phases}
            if args.process_id == 0:
                print(f"  {method} @ {rate}: {len(times) / sum(times):.2f} steps/s "
                      f"(median {statistics.median(times) * 1e3:.0f} ms, max {max(times) * 1e3:.0f} ms)", flush=True)
        set_rate(dev, "none")
    if args.process_id == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)


# ------------------------------------------------------------------------------------------- report


def classify(method, phases):
    """'exchange' for steps whose program moves outer gradients, else 'local' (DiLoCo); every step for DP."""
    if not method.startswith(("diloco", "stream")):
        return ["all"] * len(phases)
    return ["local" if p.startswith("Phase(send=None, apply=None") else "exchange" for p in phases]


def table(results, rates, throughput):
    lines = [
        "| method | " + " | ".join(f"steps/s @ {r}" for r in rates) + " | " + " | ".join(f"vs no limit @ {r}" for r in rates[1:]) + " |",
        "|---|" + "---:|" * (2 * len(rates) - 1),
    ]
    for method, res in results.items():
        rate_of = {r: len(res[r]["step_times"]) / sum(res[r]["step_times"]) for r in rates}
        lines.append(f"| {method} | " + " | ".join(f"{rate_of[r]:.2f}" for r in rates) + " | "
                     + " | ".join(f"{rate_of[r] / rate_of[rates[0]]:.2f}x" for r in rates[1:]) + " |")
    rel = [f"{r}: {throughput[r]:.0f} Mbit/s" for r in rates if r in throughput]
    return "\n".join(lines), "; ".join(rel)


def step_split(results, rates):
    lines = ["| method | rate | median local step | median exchange step | exchange steps |", "|---|---|---:|---:|---:|"]
    for method, res in results.items():
        if not method.startswith(("diloco", "stream")):
            continue
        for r in rates:
            kinds = classify(method, res[r]["phases"])
            loc = [t for t, k in zip(res[r]["step_times"], kinds) if k == "local"]
            exc = [t for t, k in zip(res[r]["step_times"], kinds) if k == "exchange"]
            lines.append(f"| {method} | {r} | {statistics.median(loc) * 1e3:.0f} ms | "
                         f"{statistics.median(exc) * 1e3:.0f} ms | {len(exc)} of {len(kinds)} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="none,1gbit,100mbit")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--periods", type=int, default=1, help="timed H-step periods per method and rate")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.rates, args.methods = args.rates.split(","), args.methods.split(",")
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    if args.worker:
        return worker(args)

    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        raise SystemExit("network namespaces need root and iproute2 (`ip`, `tc`): run as root, install iproute2.")
    from benchmarks import common

    started = common.start()
    try:
        setup()
        throughput = {}
        for r in args.rates:
            throughput[r] = link_throughput(r)
            print(f"link {r}: one TCP stream measures {throughput[r]:.0f} Mbit/s", flush=True)
        out = os.path.join(tempfile.mkdtemp(), "network.json")
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
        procs = [
            subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), "--worker",
                              "--process-id", str(i), "--out", out, "--rates", ",".join(args.rates),
                              "--methods", ",".join(args.methods), "--periods", str(args.periods)],
                             cwd=common.ROOT, env=env)
            for i, ns in enumerate(NAMESPACES)
        ]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"worker exit codes {codes}")
        with open(out) as f:
            results = json.load(f)
    finally:
        teardown()
    speeds, measured = table(results, args.rates, throughput)
    params = next(iter(results.values()))["params"]
    body = "\n\n".join([
        f"Two processes, one CPU device each, in two network namespaces joined by a veth pair; each process limits "
        f"its own egress with a `tbf` qdisc. One TCP stream measures {measured}. No latency is added (`netem` is "
        f"missing from this kernel). Model: {params:,} parameters (d_model 512, 2 layers, fp32 compute), one "
        f"sequence of 64 tokens per process per step; H = {H}; {args.periods} period(s) of H steps timed per method "
        "and rate after a warm-up period that compiles every program. Each step blocks until done.",
        speeds,
        "Where the time goes in DiLoCo: steps that run an outer exchange against those that do not.",
        step_split(results, args.rates),
    ])
    common.report(HEADING, body, no_write=args.no_write, extra_args=sys.argv[1:], started=started)


if __name__ == "__main__":
    main()
