"""The GPU compiler's schedule of a recipe's programs, compiled on a machine with no GPU.

    python benchmarks/gpu_schedule.py --config configs/tiny.py                 # 8 H200s on one host
    python benchmarks/gpu_schedule.py --config configs/diloco_8b.py --topology 1x2x8 --set mesh.replicas=2
    python benchmarks/gpu_schedule.py --config configs/tiny.py --json out.json

Needs jax's CUDA plugin without the CUDA libraries (``pip install "jax[cuda12-local]"``): jax then
describes GPUs from a target description (:mod:`benchmarks.gpu_targets`, an H100 SXM or an H200) and
compiles for them (``jax.experimental.topologies``); the CPU stays the runtime and nothing runs.

For each distinct step program of one DiLoCo period (data parallel: the one program) it reports, from
``compiled.as_text()`` (the scheduled GPU HLO, async collectives as ``-start``/``-done`` pairs):

- every collective: kind, whether a group crosses ``replica``, payload dtypes and bytes per device,
  async or synchronous, how often it runs (while-loop trip counts), and what the schedule puts between
  its start and its done: gemms, their share of the step's gemm FLOPs (a loop between them counts
  with all its iterations), other fusions and other collectives;
- the while loops (name, trip count) and the step's gemm FLOPs;
- ``compiled.memory_analysis()``: arguments, outputs, aliased and temporary bytes per device;
- narrow-integer all-reduces (they overflow, and XLA may move them out of loops): flagged;
- LoCo's exchange (its ``uint8`` collectives inside a replica): how many per step, how many synchronous,
  and the share of the backward pass's gemm FLOPs scheduled under one of them (the backward pass of the
  micro-batch that carries the exchange: :func:`exchange_overlap`).

No kernel autotuning runs without a GPU, so kernel choices may differ from a real device; the
collectives, their order and the buffer plan are the compiler's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/

from loco_jax import hlo  # noqa: E402
from loco_jax.collectives import OWN_STREAM  # noqa: E402
from loco_jax.diloco import APPLY_GATHER  # noqa: E402

NARROW_INTS = ("s1", "u1", "s2", "u2", "s4", "u4", "s8", "u8", "s16", "u16", "pred")
GEMM_TARGETS = ("gemm", "matmul")  # custom-call targets: __cublas$gemm, __cublas$lt$matmul, ...


@dataclasses.dataclass
class Collective:
    """One collective of a program, with what its start/done pair has scheduled between them."""

    name: str
    kind: str
    computation: str
    crosses_replica: bool
    dtypes: tuple[str, ...]
    bytes: float  # the result's bytes per device, one run
    is_async: bool
    count: int  # runs per step (trip counts of the loops around it)
    own_stream: bool = False  # hinted onto XLA:GPU's p2p collective stream (collectives.on_own_stream)
    gemms_under: int = 0
    gemm_flops_under: float = 0.0
    fusions_under: int = 0
    collectives_under: tuple[str, ...] = ()

    @property
    def narrow_int_all_reduce(self) -> bool:
        return self.kind == "all-reduce" and any(d in NARROW_INTS for d in self.dtypes)


@dataclasses.dataclass
class Schedule:
    """What :func:`analyze` reads from one program's scheduled HLO."""

    collectives: list[Collective]
    gemm_flops: float  # one step, every loop iteration counted
    gemms: int
    while_loops: list[tuple[str, int | None]]  # (name, trip count) of every loop the step runs
    memory: dict | None = None
    exchange: ExchangeOverlap | None = None  # LoCo's uint8 collectives against the carried backward pass

    def cross_replica(self) -> list[Collective]:
        return [c for c in self.collectives if c.crosses_replica]

    def share_under(self, collective: Collective) -> float:
        """Fraction of the step's gemm FLOPs scheduled between ``collective``'s start and done."""
        return collective.gemm_flops_under / self.gemm_flops if self.gemm_flops else 0.0


def _prod(dims):
    return math.prod(dims) if dims else 1


def _dims_of(shape: str) -> tuple[int, ...]:
    return hlo.parse_shape(shape)[1]


def _is_sync(ins) -> bool:
    return '"is_sync":true' in ins.attrs.get("backend_config", "").replace(" ", "")


def _own_stream(ins) -> bool:
    attributes = ins.attrs.get("frontend_attributes", "").replace(" ", "")
    return all(f'{k}="{v}"' in attributes for k, v in OWN_STREAM.items())


class _Program:
    def __init__(self, text: str, replicas: int, devices: int):
        self.module = hlo.parse_module(text, every_instruction=True)
        self.per_replica = devices // replicas
        self.replicas = replicas
        self.shapes = {c: {i.name: i.shape for i in comp.instrs} for c, comp in self.module.comps.items()}

    # ---- FLOPs of gemms (a dot, a fusion around one, a cuBLAS custom call), loops multiplied out
    def _dot_flops(self, cname, ins) -> float:
        lhs = _dims_of(self.shapes[cname].get(ins.operands[0], "f32[]"))
        contracting = hlo.parse_dims(ins.attrs.get("lhs_contracting_dims", "{}").strip("{}"))
        return 2.0 * _prod(_dims_of(ins.shape)) * _prod([lhs[d] for d in contracting if d < len(lhs)])

    def _custom_gemm_flops(self, cname, ins) -> float:
        try:
            numbers = json.loads(ins.attrs.get("backend_config", "{}"))
            numbers = numbers.get("gemm_backend_config", numbers).get("dot_dimension_numbers", {})
            contracting = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
        except (ValueError, AttributeError):
            contracting = []
        lhs = _dims_of(self.shapes[cname].get(ins.operands[0], "f32[]"))
        out = hlo.parse_shapes(ins.shape)[0][1]  # a cuBLAS call returns (result, workspace)
        return 2.0 * _prod(out) * _prod([lhs[d] for d in contracting if d < len(lhs)])

    @functools.cache
    def cost(self, cname: str) -> tuple[float, int]:
        """(gemm FLOPs, gemm count) of one run of computation ``cname``."""
        flops, gemms = 0.0, 0
        for ins in self.module.comps[cname].instrs if cname in self.module.comps else ():
            f, g = self.instr_cost(cname, ins)
            flops, gemms = flops + f, gemms + g
        return flops, gemms

    def instr_cost(self, cname, ins) -> tuple[float, int]:
        op = ins.opcode
        if op == "dot":
            return self._dot_flops(cname, ins), 1
        if op == "custom-call" and any(t in ins.attrs.get("custom_call_target", "").lower() for t in GEMM_TARGETS):
            return self._custom_gemm_flops(cname, ins), 1
        callees = hlo.computation_names(ins.attrs.get("calls", "")) if op in ("fusion", "call", "async-start") else []
        if op == "fusion":
            flops = sum(self.cost(c)[0] for c in callees)
            return flops, int(flops > 0)
        if op in ("call", "async-start"):
            costs = [self.cost(c) for c in callees]
            return sum(c[0] for c in costs), sum(c[1] for c in costs)
        if op == "while":
            trip = hlo.trip_count(ins.attrs) or 1
            f, g = self.cost(hlo.computation_names(ins.attrs.get("body", ""))[0])
            return trip * f, trip * g
        if op == "conditional":
            branches = hlo.computation_names(ins.attrs.get("branch_computations", "")) + [
                c for k in ("true_computation", "false_computation") for c in hlo.computation_names(ins.attrs.get(k, ""))]
            costs = [self.cost(c) for c in branches]
            return max(costs, default=(0.0, 0))
        return 0.0, 0

    # ---- collectives, walked through loops and calls in schedule order
    def crosses(self, ins, kind) -> bool:
        if self.replicas == 1:
            return False
        if kind == "collective-permute":
            pairs = [int(x) for x in re.findall(r"\d+", ins.attrs.get("source_target_pairs", ""))]
            return any(a // self.per_replica != b // self.per_replica for a, b in zip(pairs[::2], pairs[1::2]))
        groups = hlo.replica_groups(ins.attrs.get("replica_groups"))
        if groups is None:
            return True  # one group of every device
        return any(len({d // self.per_replica for d in g}) > 1 for g in groups)

    def collectives(self) -> tuple[list[Collective], list[tuple[str, int | None]]]:
        found, loops = [], []
        self._walk(self.module.entry, 1, found, loops, ())
        return found, loops

    def _walk(self, cname, mult, found, loops, stack):
        comp = self.module.comps.get(cname)
        if comp is None or cname in stack:
            return
        stack += (cname,)
        instrs = comp.instrs
        done_at = {}
        for j, ins in enumerate(instrs):
            if ins.opcode.endswith("-done") and ins.operands:
                done_at[ins.operands[0]] = j
        for i, ins in enumerate(instrs):
            kind, is_start = hlo.collective_kind(ins.opcode)
            inner = ins
            if ins.opcode == "async-start":  # a collective wrapped in an async computation
                wrapped = [x for c in hlo.computation_names(ins.attrs.get("calls", ""))
                           for x in self.module.comps.get(c, hlo.Computation(c, False, [])).instrs
                           if hlo.collective_kind(x.opcode)[0]]
                if wrapped:
                    inner, kind, is_start = wrapped[0], hlo.collective_kind(wrapped[0].opcode)[0], True
            if kind is not None:
                j = done_at.get(ins.name) if is_start else None
                result = instrs[j].shape if j is not None else inner.shape
                shapes = hlo.parse_shapes(result)
                c = Collective(
                    name=ins.name, kind=kind, computation=cname, crosses_replica=self.crosses(inner, kind),
                    dtypes=tuple(sorted({d for d, _ in shapes})), bytes=sum(hlo.array_bytes(d, s) for d, s in shapes),
                    is_async=is_start and j is not None and not _is_sync(ins), count=mult,
                    own_stream=_own_stream(ins) or _own_stream(inner))
                if j is not None:
                    between = instrs[i + 1:j]
                    for b in between:
                        f, g = self.instr_cost(cname, b)
                        c.gemm_flops_under += f
                        c.gemms_under += g
                        c.fusions_under += b.opcode == "fusion" and g == 0
                    c.collectives_under = tuple(b.name for b in between if hlo.collective_kind(b.opcode)[0]
                                                or b.opcode == "async-start")
                found.append(c)
            if ins.opcode == "while":
                trip = hlo.trip_count(ins.attrs)
                loops.append((ins.name, trip))
                for body in hlo.computation_names(ins.attrs.get("body", "")):
                    self._walk(body, mult * (trip or 1), found, loops, stack)
            elif ins.opcode in ("call", "conditional"):
                for key in ("to_apply", "calls", "branch_computations", "true_computation", "false_computation"):
                    for callee in hlo.computation_names(ins.attrs.get(key, "")):
                        self._walk(callee, mult, found, loops, stack)


def _op_name(ins) -> str:
    m = re.search(r'op_name="([^"]*)"', ins.attrs.get("metadata", ""))
    return m.group(1) if m else ""


@dataclasses.dataclass
class ExchangeOverlap:
    """How much of the backward pass runs under LoCo's exchange (its ``uint8`` collectives inside a replica)."""

    flops_under: float  # gemm FLOPs of the backward pass scheduled between a LoCo start and its done
    backward_flops: float  # gemm FLOPs of one micro-batch's backward pass (the one that carries the exchange)
    step_flops: float  # every gemm FLOP of the step
    collectives: int  # LoCo collectives per step (loops multiplied out)
    synchronous: int  # of which synchronous

    @property
    def share(self) -> float:
        return self.flops_under / self.backward_flops if self.backward_flops else 0.0


def exchange_overlap(text, replicas: int, devices: int, micro_batches: int = 1) -> ExchangeOverlap:
    """:class:`ExchangeOverlap` of one compiled program (its HLO text, or the parsed program). LoCo's collectives: ``uint8`` payloads whose groups
    stay inside a replica (DiLoCo's exchange crosses ``replica``; its apply's gather of codes inside the
    replica is named ``diloco.APPLY_GATHER``). The backward pass: gemms that JAX names
    as transposes (``transpose(jvp(...))`` in their ``op_name``, a rematerialised forward included); its
    FLOPs per micro-batch (the step's over ``micro_batches``) are the denominator: compressing once per
    step needs the sum of every micro-batch, so only the last one's backward pass can carry the exchange.
    A gemm under two collectives counts once; a loop counts with its trip count."""
    program = text if isinstance(text, _Program) else _Program(text, replicas, devices)
    totals = dict(under=0.0, backward=0.0, collectives=0, sync=0)

    def backward_cost(cname, ins):
        if ins.opcode in ("while", "call", "conditional"):
            return None  # walked into below, with its own trip count
        flops, _ = program.instr_cost(cname, ins)
        return flops if flops and "transpose(" in _op_name(ins) else 0.0

    def walk(cname, mult, stack, covered):
        """``covered``: the computation runs under a LoCo collective started outside it (all of it counts)."""
        comp = program.module.comps.get(cname)
        if comp is None or cname in stack:
            return
        instrs = comp.instrs
        done_at = {ins.operands[0]: j for j, ins in enumerate(instrs) if ins.opcode.endswith("-done") and ins.operands}
        under = set()
        for i, ins in enumerate(instrs):
            kind, is_start = hlo.collective_kind(ins.opcode)
            if kind is None:
                continue
            j = done_at.get(ins.name) if is_start else None
            shapes = hlo.parse_shapes(instrs[j].shape if j is not None else ins.shape)
            if (any(d == "u8" for d, _ in shapes) and not program.crosses(ins, kind)
                    and APPLY_GATHER not in _op_name(ins)):
                totals["collectives"] += mult
                if j is None or _is_sync(ins):
                    totals["sync"] += mult
                else:
                    under.update(range(i + 1, j))
        for i, ins in enumerate(instrs):
            flops = backward_cost(cname, ins)
            if flops is None:
                trip = (hlo.trip_count(ins.attrs) or 1) if ins.opcode == "while" else 1
                keys = ("body",) if ins.opcode == "while" else ("to_apply", "calls", "branch_computations")
                for key in keys:
                    for callee in hlo.computation_names(ins.attrs.get(key, "")):
                        walk(callee, mult * trip, stack + (cname,), covered or i in under)
                continue
            totals["backward"] += mult * flops
            if covered or i in under:
                totals["under"] += mult * flops

    walk(program.module.entry, 1, (), False)
    return ExchangeOverlap(totals["under"], totals["backward"] / micro_batches, program.cost(program.module.entry)[0],
                           totals["collectives"], totals["sync"])


def analyze(text: str, replicas: int, devices: int, memory=None, micro_batches: int = 1) -> Schedule:
    """The schedule of one compiled program's HLO text on ``devices`` devices, ``replicas`` of them on the
    ``replica`` axis (devices numbered replica-major, as :func:`loco_jax.training.run.mesh.make_mesh` lays
    them out)."""
    program = _Program(text, replicas, devices)
    collectives, loops = program.collectives()
    flops, gemms = program.cost(program.module.entry)
    return Schedule(collectives, flops, gemms, loops, memory, exchange_overlap(program, replicas, devices, micro_batches))


def _memory(compiled) -> dict | None:
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    names = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
    return {n.replace("_size_in_bytes", ""): int(getattr(stats, n)) for n in names}


# --------------------------------------------------------------------------- compiling a recipe for GPUs


def gpu_devices(topology: str = "1x1x8", target: str = "h200"):
    """Compile-only GPU devices: ``topology`` hosts x devices (``1x1x8``: one host of 8; ``1x2x8``: two)."""
    from jax.experimental import topologies

    from benchmarks import gpu_targets

    desc = topologies.get_topology_desc(platform="cuda", topology=topology,
                                        target_config=gpu_targets.target_config(target))
    return list(desc.devices)


# A compile-only device has no cuDNN to build the fused attention kernel that model.attention="auto"
# takes on GPUs ("cuDNN not found"), so these programs use XLA's attention (benchmarks/gpu_check.sh
# compiles and runs the cuDNN one on a lent GPU). Everything else is the trainer's own program.
DEVICELESS = ("model.attention=xla",)


def compile_recipe(config_path: str, overrides=(), topology: str = "1x1x8", target: str = "h200",
                   first: int | None = None) -> dict:
    """{phase: (compiled program, Schedule)} for every distinct step program of one period of a recipe
    (``first``: only the first that many, in step order from step H + 1: a send program, then the quiet one)."""
    from loco_jax.training.run import config as config_lib
    from loco_jax.training.run.trainer import Trainer

    cfg = config_lib.load(config_path, list(DEVICELESS) + list(overrides) + ["sample_tokens=0"])
    devices = gpu_devices(topology, target)
    trainer = Trainer(cfg, workdir=None, log=lambda *_: None, devices=devices)
    state, batch = trainer.abstract_state(), trainer.abstract_batch()
    h = cfg.diloco.sync_every
    steps = range(h + 1, 2 * h + 1) if cfg.diloco.enabled else [1]
    out = {}
    for step in steps:
        phase = trainer.phase(step)
        if str(phase) in out:
            continue
        if first is not None and len(out) >= first:
            break
        compiled = trainer.program(phase, state, batch)
        out[str(phase)] = (compiled, analyze(compiled.as_text(), trainer.m, len(devices), _memory(compiled),
                                             trainer.accum_steps))
    return out


def report(schedules: dict, title: str) -> str:
    lines = [f"### {title}", ""]
    for phase, (_, s) in schedules.items():
        cross = s.cross_replica()
        mem = s.memory or {}
        lines += [f"Program `{phase}`: {s.gemms} gemms, {s.gemm_flops / 1e12:.3f} TFLOP per step; while loops: "
                  + (", ".join(f"{n} ({t})" for n, t in s.while_loops) or "none")
                  + (f"; memory per device: arguments {hlo.human_bytes(mem['argument'])}, temporaries "
                     f"{hlo.human_bytes(mem['temp'])}, outputs {hlo.human_bytes(mem['output'])} (aliased "
                     f"{hlo.human_bytes(mem['alias'])})" if mem else ""), "",
                  "| collective | kind | crosses replica | payload | bytes/device | async | runs | gemms under "
                  "| share of gemm FLOPs under | fusions under | collectives under |",
                  "|---|---|---|---|---:|---|---:|---:|---:|---:|---|"]
        for c in s.collectives:
            flag = " **narrow-int all-reduce**" if c.narrow_int_all_reduce else ""
            how = ("async" if c.is_async else "sync") + (", own stream" if c.own_stream else "")
            lines.append(f"| `{c.name}`{flag} | {c.kind} | {'yes' if c.crosses_replica else 'no'} | "
                         f"{'/'.join(c.dtypes)} | {hlo.human_bytes(c.bytes)} | {how} | "
                         f"{c.count} | {c.gemms_under} | {100 * s.share_under(c):.1f} % | {c.fusions_under} | "
                         f"{len(c.collectives_under)} |")
        lines += ["", f"Crossing `replica`: {len(cross)} collective(s)"
                  + (f", {sum(not c.is_async for c in cross)} synchronous" if cross else "") + ".", ""]
        x = s.exchange
        if x is not None and x.collectives:
            lines += [f"LoCo's exchange (uint8 inside a replica): {x.collectives} collective(s) per step, "
                      f"{x.synchronous} synchronous; {100 * x.share:.1f} % of a micro-batch's backward gemm FLOPs "
                      f"under one ({x.flops_under / 1e12:.2f} of {x.backward_flops / 1e12:.2f} TFLOP; the step: "
                      f"{x.step_flops / 1e12:.2f} TFLOP).", ""]
    return "\n".join(lines)


def to_json(schedules: dict) -> dict:
    return {phase: {"gemm_flops": s.gemm_flops, "gemms": s.gemms, "while_loops": s.while_loops, "memory": s.memory,
                     "exchange": None if s.exchange is None else dict(dataclasses.asdict(s.exchange),
                                                                      share=s.exchange.share),
                    "collectives": [dict(dataclasses.asdict(c), share_under=s.share_under(c))
                                    for c in s.collectives]}
            for phase, (_, s) in schedules.items()}


def main(argv=None):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CPU runs; the GPUs are only compiled for
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--topology", default="1x1x8", help="hosts x GPUs: 1x1x8 (one host of 8) or 1x2x8 (two)")
    ap.add_argument("--target", default="h200", choices=("h200", "h100"))
    ap.add_argument("--json", default=None, help="also write the figures as JSON to this file")
    ap.add_argument("--first", type=int, default=None,
                    help="compile only the first N distinct programs from step H + 1 (2: a send and the quiet one)")
    args = ap.parse_args(argv)
    schedules = compile_recipe(args.config, args.overrides, args.topology, args.target, args.first)
    print(report(schedules, f"{args.config} on {args.topology} {args.target.upper()}"
                 + (f" ({' '.join(args.overrides)})" if args.overrides else "")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(schedules), f, indent=1)


if __name__ == "__main__":
    main()
