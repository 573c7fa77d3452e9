"""Bytes that collectives move, read from compiled HLO text.

:func:`collective_bytes` parses the HLO module text of a compiled program (a
``jax.stages.Compiled``, a ``jax.stages.Lowered`` which is compiled first, or a
plain HLO text string) and returns a :class:`CollectiveReport` with one
:class:`CollectiveOp` row per collective instruction that the program executes.

What is counted
---------------
* ``all-reduce``, ``all-gather``, ``all-to-all``, ``reduce-scatter``,
  ``collective-permute`` and ``collective-broadcast``, in the synchronous form
  and in the asynchronous forms: ``<op>-start`` / ``<op>-done`` pairs (counted
  once, from the start op; the payload shape is taken from the matching done
  op, since the start op's shape also holds the operands / context buffers),
  and the generic ``async-start`` / ``async-update`` / ``async-done`` wrappers
  (counted once, from the collective inside the computation that
  ``async-start``'s ``calls=`` names; update/done are never walked).
* Only computations reachable from ENTRY are walked, through ``while`` bodies
  (and conditions), ``conditional`` branches, ``call``, ``fusion``,
  ``async-start`` and ``custom-call`` callees.  Reduction computations
  (``to_apply=`` of all-reduce, reduce, ...) are not walked.  A computation
  reached from several call sites is reported once per call site.
* Not counted: ``send``/``recv``, ``ragged-all-to-all``, host transfers and
  anything a custom call does internally.

Bytes: per device, per run of the program
-----------------------------------------
``bytes_per_device`` is the number of bytes each participating device sends
over the wire for ONE execution of the op, using the bandwidth-optimal ring
algorithms.  With ``n`` the group size (participants per replica group) and
``S`` the bytes of the op's result (summed over tuple elements):

====================  =====================  ===============================
kind                  bytes sent per device  S is ...
====================  =====================  ===============================
all-reduce            2 (n-1)/n * S          the (reduced) result
all-gather            (n-1)/n * S            the gathered result
all-to-all            (n-1)/n * S            the result (sum over tuple)
reduce-scatter        (n-1) * S              the scattered shard (result);
                                             the input is n * S
collective-permute    S                      the result
collective-broadcast  S                      the result
====================  =====================  ===============================

A group of one device moves 0 bytes (except permute/broadcast, which count S).
Fractional bytes (s4 / u4 payloads, n not dividing S) are kept as floats.

``count`` is how many times the op runs per program run: 1, multiplied by the
trip count of every enclosing ``while`` whose trip count XLA recorded
(``backend_config={"known_trip_count":{"n":"5"}}`` or a ``known_trip_count``
frontend attribute); nested loops multiply.  Inside a loop with an unknown trip
count the row is counted once and flagged ``per_iteration=True`` (its bytes are
per loop iteration).  ``total_bytes = count * bytes_per_device``.

Group size comes from ``replica_groups``: the explicit list form
``{{0,1,2,3},{4,5,6,7}}`` (size of the largest group), the iota form
``[2,4]<=[8]`` or ``[4,2]<=[2,4]T(1,0)`` (last dimension of the group shape),
or, when empty/missing, the whole module, following XLA's group modes: with
``use_global_device_ids=true`` the ids are global devices (empty = replica_count
* num_partitions); with a ``channel_id`` only, all-to-all / collective-permute
index partitions (empty = num_partitions) while all-reduce / all-gather /
reduce-scatter index replicas spanning every partition (a group of ``k``
replicas has ``k * num_partitions`` members); without a channel_id the groups
index replicas (empty = replica_count).  ``replica_count`` and
``num_partitions`` come from the ``HloModule`` header line (default 1).  For a
collective-permute the group size is the number of distinct devices named in
``source_target_pairs`` (informational only; it is not used by the formula).

Conditionals
------------
Rows inside ``conditional`` branches carry a ``branch`` id ("<conditional
call path>:<branch index>") and the full ``branch_path``.  Only one branch runs
per execution, so :attr:`CollectiveReport.total` does NOT add branches up: it is
the sum over rows outside conditionals plus, for every conditional, the
largest total over its branches (nested conditionals resolved recursively): the
per-run upper bound.  :attr:`CollectiveReport.total_min` takes the smallest
branch instead (a branch without collectives counts 0): the lower bound.
``by_kind()`` / ``by_dtype()`` default to the same heaviest-branch selection so
that their values sum to ``total``.

Why one module of this size, in the library: it is the one HLO text reader the project has (the
trainer's ``programs.json``, the tests' uint8 assertions and the benchmarks all count bytes with it, and
users check their own steps with it, as the README's recipe does); splitting the parser from the byte
count would leave two halves that only work together.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from typing import Any, Iterable

import numpy as np

__all__ = [
    "CollectiveOp",
    "CollectiveReport",
    "collective_bytes",
    "dtype_bytes",
    "parse_shape",
    "parse_shapes",
    "human_bytes",
    "replica_groups",
    "COLLECTIVE_KINDS",
    "UnorderedCollectives",
    "unordered_collectives",
]

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "all-to-all",
    "reduce-scatter",
    "collective-permute",
    "collective-broadcast",
)

# ---------------------------------------------------------------------------
# Element types and shapes
# ---------------------------------------------------------------------------

_DTYPE_BYTES = {
    "pred": 1.0,
    "token": 0.0,
    "opaque": 0.0,
    "s1": 0.125,
    "u1": 0.125,
    "s2": 0.25,
    "u2": 0.25,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1.0,
    "u8": 1.0,
    "s16": 2.0,
    "u16": 2.0,
    "f16": 2.0,
    "bf16": 2.0,
    "s32": 4.0,
    "u32": 4.0,
    "f32": 4.0,
    "s64": 8.0,
    "u64": 8.0,
    "f64": 8.0,
    "c64": 8.0,
    "c128": 16.0,
}


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of an HLO element type ("f32" -> 4.0, "s4" -> 0.5).

    All 8-bit float types (``f8e4m3fn``, ``f8e5m2``, ...) are 1 byte, 6-bit
    floats 0.75 and 4-bit floats 0.5.  Raises ``ValueError`` for unknown types.
    """
    d = dtype.strip().lower()
    if d in _DTYPE_BYTES:
        return _DTYPE_BYTES[d]
    m = re.fullmatch(r"f(\d+)e\d+m\d+\w*", d)
    if m:
        return int(m.group(1)) / 8.0
    raise ValueError(f"unknown HLO element type {dtype!r}")


_ARRAY_RE = re.compile(r"([A-Za-z][A-Za-z0-9]*)\[([^\]]*)\]")


def parse_dims(text: str) -> tuple[int, ...]:
    """``"4,<=100,?"`` -> ``(4, 100, 0)``: a dimension list (a shape's, or ``lhs_contracting_dims``'), bounds
    read as their bound and unknown dimensions as 0."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        part = part.lstrip("<=").strip()  # dynamic dims print as "<=N" (bound)
        try:
            out.append(int(part))
        except ValueError:
            out.append(0)  # unknown "?" dimension
    return tuple(out)


def parse_shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """All array shapes in an HLO shape string, tuples flattened in order.

    ``"(u8[4,100]{1,0}, f32[])"`` -> ``[("u8", (4, 100)), ("f32", ())]``.
    Layouts (``{1,0}``, ``{1,0:T(8,128)}``) are ignored.
    """
    return [(m.group(1), parse_dims(m.group(2))) for m in _ARRAY_RE.finditer(text)]


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """``"f32[4,128]{1,0}"`` -> ``("f32", (4, 128))`` for an array shape.

    Raises ``ValueError`` for a tuple shape with more than one array (use
    :func:`parse_shapes`) or for text that holds no shape.
    """
    shapes = parse_shapes(text)
    if len(shapes) != 1:
        raise ValueError(f"expected a single array shape, got {text!r}")
    return shapes[0]


def array_bytes(dtype: str, shape: tuple[int, ...]) -> float:
    """Bytes of an array of HLO ``dtype`` (``"u8"``, ``"f32"``, ...) and ``shape`` (sub-byte types: fractions)."""
    return math.prod(shape) * dtype_bytes(dtype)


# ---------------------------------------------------------------------------
# Low-level text helpers
# ---------------------------------------------------------------------------

_OPEN = {"(": ")", "{": "}", "[": "]"}
_CLOSE = {")", "}", "]"}


_STR_RE = re.compile(r'"(?:[^"\\]|\\.)*"')


def _depth_change(text: str) -> int:
    """Net bracket depth of ``text``, ignoring brackets inside quoted strings."""
    if '"' in text:
        text = _STR_RE.sub("", text)
    return (
        text.count("(") + text.count("{") + text.count("[")
        - text.count(")") - text.count("}") - text.count("]")
    )


def _walk(text: str, start: int = 0):
    """``(index, char, depth)`` of each character outside double-quoted strings.

    ``depth`` counts the brackets open after that character.
    """
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
            continue
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
        yield i, ch, depth


def _match_close(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``text[start]``."""
    for i, ch, depth in _walk(text, start):
        if ch in _CLOSE and depth == 0:
            return i
    raise ValueError(f"unbalanced brackets in {text!r}")


def _split_top(text: str, sep: str = ",") -> list[str]:
    """Split at ``sep`` characters that are outside brackets and strings."""
    cuts = [i for i, ch, depth in _walk(text) if ch == sep and depth == 0]
    pieces = [text[i + 1 : j].strip() for i, j in zip([-1] + cuts, cuts + [len(text)])]
    if pieces and not pieces[-1]:
        pieces.pop()  # a trailing separator leaves nothing behind
    return pieces


def _tuple_elements(shape_text: str) -> list[str]:
    """Top-level elements of a tuple shape; ``[shape_text]`` for an array."""
    s = shape_text.strip()
    if s.startswith("("):
        end = _match_close(s, 0)
        return _split_top(s[1:end])
    return [s]


def computation_names(value: str) -> list[str]:
    """``%a`` / ``{%a, %b}`` / ``a`` -> ["a", "b"]."""
    v = value.strip()
    if v.startswith("{") and v.endswith("}"):
        v = v[1:-1]
    out = []
    for part in _split_top(v):
        part = part.strip()
        if part and not part.startswith("{"):
            out.append(part.lstrip("%"))
    return out


# ---------------------------------------------------------------------------
# HLO module parsing
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Instruction:
    """One HLO instruction as :func:`parse_module` reads it: its shape's text, operands and attributes."""

    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: dict[str, str]
    is_root: bool = False


@dataclasses.dataclass
class Computation:
    """One HLO computation (the entry, a fusion, a loop body...) and its instructions in text order."""

    name: str
    is_entry: bool
    instrs: list[Instruction]


_INSTR_RE = re.compile(r"^%?([^\s=]+)\s*=\s*(.*)$", re.S)
_OPCODE_RE = re.compile(r"\s*([A-Za-z][\w\-]*)\s*\(")


def _parse_instr(text: str, every: bool = False) -> Instruction | None:
    s = re.sub(r"/\*.*?\*/", "", text).strip()  # drop /*index=5*/ comments
    is_root = False
    if s.startswith("ROOT "):
        is_root = True
        s = s[5:].lstrip()
    m = _INSTR_RE.match(s)
    if not m:
        return None
    name, rest = m.group(1), m.group(2).lstrip()
    if not rest:
        return None
    if rest.startswith("("):
        end = _match_close(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :]
    else:
        sm = re.match(r"\S+", rest)
        shape, rest = sm.group(0), rest[sm.end() :]
    om = _OPCODE_RE.match(rest)
    if not om:
        return None
    opcode = om.group(1)
    if not every and not _interesting(opcode):
        return None  # skip the (slow) operand/attribute parsing
    open_idx = om.end() - 1
    close_idx = _match_close(rest, open_idx)
    operand_text = rest[open_idx + 1 : close_idx]
    operands = []
    for op in _split_top(operand_text):
        tok = op.split()[-1] if op.split() else ""
        operands.append(tok.lstrip("%"))
    attrs: dict[str, str] = {}
    for part in _split_top(rest[close_idx + 1 :]):
        if "=" in part:
            k, v = part.split("=", 1)
            attrs[k.strip()] = v.strip()
        elif part:
            attrs[part.strip()] = ""
    return Instruction(name, shape, opcode, operands, attrs, is_root)


_WALKED_OPCODES = frozenset(["while", "conditional", "call", "fusion", "async-start", "custom-call"])


def _interesting(opcode: str) -> bool:
    return (
        opcode in _WALKED_OPCODES
        or collective_kind(opcode)[0] is not None
        or opcode.endswith("-done")
        or opcode.endswith("-update")
    )


def _is_comp_header(line: str) -> bool:
    s = line.strip()
    if not s.endswith("{"):
        return False
    head = re.split(r"[({]", s, maxsplit=1)[0]
    return "=" not in head and bool(head.strip())


@dataclasses.dataclass
class ParsedModule:
    """An HLO module as :func:`parse_module` reads it: its computations by name and the entry's."""

    name: str
    replica_count: int
    num_partitions: int
    comps: dict[str, Computation]
    entry: str | None


def parse_module(text: str, every_instruction: bool = False) -> ParsedModule:
    """The module's computations; only the instructions the byte count needs unless ``every_instruction``
    (a schedule's order needs them all)."""
    name = ""
    replica_count = 1
    num_partitions = 1
    comps: dict[str, Computation] = {}
    entry = None
    current: Computation | None = None
    pending: list[str] = []
    depth = 0
    for raw in text.splitlines():
        line = raw.strip()
        if pending:
            pending.append(line)
            depth += _depth_change(line)
            if depth <= 0:
                ins = _parse_instr(" ".join(pending), every_instruction)
                if ins is not None and current is not None:
                    current.instrs.append(ins)
                pending, depth = [], 0
            continue
        if not line or line.startswith("//") or line.startswith("#"):
            continue
        if current is None:
            if line.startswith("HloModule"):
                hm = re.match(r"HloModule\s+([^\s,]+)", line)
                name = hm.group(1) if hm else ""
                rm = re.search(r"\breplica_count=(\d+)", line)
                pm = re.search(r"\bnum_partitions=(\d+)", line)
                replica_count = int(rm.group(1)) if rm else 1
                num_partitions = int(pm.group(1)) if pm else 1
                continue
            if _is_comp_header(line):
                is_entry = line.startswith("ENTRY")
                head = line[5:].strip() if is_entry else line
                cname = re.split(r"[\s({]", head, maxsplit=1)[0].lstrip("%")
                current = Computation(cname, is_entry, [])
                comps[cname] = current
                if is_entry:
                    entry = cname
            continue
        if line.startswith("}"):
            current = None
            continue
        d = _depth_change(line)
        if d > 0:
            pending, depth = [line], d
            continue
        ins = _parse_instr(line, every_instruction)
        if ins is not None:
            current.instrs.append(ins)
    if entry is None and comps:
        entry = list(comps)[-1]  # XLA prints the entry computation last
    return ParsedModule(name, replica_count, num_partitions, comps, entry)


# ---------------------------------------------------------------------------
# Group sizes, trip counts
# ---------------------------------------------------------------------------


def _parse_groups(value: str | None) -> tuple[list[list[int]] | None, int | None]:
    """Returns (explicit groups, iota group size).  ``([], None)`` for empty."""
    if value is None:
        return [], None
    v = value.strip()
    iota = re.match(r"\[([\d,\s]+)\]\s*<=\s*\[", v)
    if iota:
        dims = parse_dims(iota.group(1))
        return None, dims[-1] if dims else None
    if v.startswith("{"):
        inner = v[1:-1].strip()
        groups = []
        for g in re.findall(r"\{([^{}]*)\}", inner):
            groups.append([int(x) for x in g.replace(" ", "").split(",") if x])
        return groups, None
    return [], None


def replica_groups(value: str | None) -> tuple[tuple[int, ...], ...] | None:
    """The device groups of a ``replica_groups`` attribute; None when empty (every device, one group).

    Handles the list form ``{{0,1},{2,3}}`` and the iota form ``[g,n]<=[N]`` or
    ``[g,n]<=[a,b]T(1,0)`` (an iota over ``[a,b]``, transposed, viewed as ``g`` groups of ``n``).
    """
    if value is None or not value.strip() or value.strip() == "{}":
        return None
    v = value.strip()
    iota = re.match(r"\[([\d,\s]+)\]\s*<=\s*\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?", v)
    if iota:
        out_dims, src_dims = parse_dims(iota.group(1)), parse_dims(iota.group(2))
        ids = np.arange(int(np.prod(src_dims))).reshape(src_dims)
        if iota.group(3):
            ids = ids.transpose(parse_dims(iota.group(3)))
        ids = ids.reshape(-1, out_dims[-1])
        return tuple(tuple(int(x) for x in row) for row in ids)
    groups, _ = _parse_groups(v)
    return tuple(tuple(g) for g in groups) if groups else None


def _group_size(kind: str, attrs: dict[str, str], replica_count: int, num_partitions: int) -> int:
    if kind == "collective-permute":
        ids = set(int(x) for x in re.findall(r"\d+", attrs.get("source_target_pairs", "")))
        return max(len(ids), 1)
    groups, iota_size = _parse_groups(attrs.get("replica_groups"))
    ugdi = attrs.get("use_global_device_ids", "").lower() == "true"
    has_channel = "channel_id" in attrs
    if ugdi:
        mode = "flattened"
    elif has_channel:
        mode = "cross_partition" if kind in ("all-to-all", "collective-broadcast") else "cross_replica_and_partition"
    else:
        mode = "cross_replica"
    if iota_size is not None:
        size = iota_size
        ids_max = None
    elif groups:
        size = max(len(g) for g in groups)
        ids_max = max((max(g) for g in groups if g), default=0)
    else:
        return {
            "flattened": replica_count * num_partitions,
            "cross_partition": num_partitions,
            "cross_replica_and_partition": replica_count * num_partitions,
            "cross_replica": replica_count,
        }[mode]
    if mode == "cross_replica_and_partition" and (ids_max is None or ids_max < replica_count):
        # Groups hold replica ids; each group spans all partitions.  (If the
        # ids exceed replica_count they can only be partition/device ids.)
        size *= num_partitions
    return max(size, 1)


_TRIP_RE = re.compile(r"known_trip_count\"?\s*[:=]\s*(?:\{\s*\"?n\"?\s*:\s*)?\"?(\d+)")


def trip_count(attrs: dict[str, str]) -> int | None:
    """A ``while`` loop's known trip count from its attributes (``backend_config`` or ``frontend_attributes``),
    or None where the compiler recorded none."""
    for key in ("backend_config", "frontend_attributes"):
        val = attrs.get(key)
        if not val:
            continue
        if key == "backend_config":
            try:
                cfg = json.loads(val)
                n = cfg.get("known_trip_count", {}).get("n")
                if n is not None:
                    return int(n)
            except (ValueError, AttributeError, TypeError):
                pass
        m = _TRIP_RE.search(val)
        if m:
            return int(m.group(1))
    return None


def _ring_bytes(kind: str, n: int, s: float) -> float:
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * s
    if kind in ("all-gather", "all-to-all"):
        return (n - 1) / n * s
    if kind == "reduce-scatter":
        return float((n - 1) * s)
    if kind in ("collective-permute", "collective-broadcast"):
        return float(s)
    raise ValueError(kind)


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction, as executed per run of the program.

    ``shape`` is the result shape of a single-array result; for a tuple result
    (multi-operand all-to-all / combined all-reduce) it is the shape of the
    FIRST element, and ``shapes`` always lists every element's shape (with
    ``dtypes`` the matching element types).  ``dtype`` is the payload element
    type, or ``"mixed(a,b)"`` when tuple elements differ.
    """

    kind: str
    dtype: str
    shape: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    count: int
    group_size: int
    payload_bytes: float  # S: result bytes, summed over tuple elements
    bytes_per_device: float  # ring wire bytes per device for ONE execution
    total_bytes: float  # count * bytes_per_device
    computation: str
    context: str
    per_iteration: bool
    branch: str | None
    branch_path: tuple[tuple[str, int, int], ...] = ()  # (conditional id, branch index, #branches)
    name: str = ""  # HLO instruction name (the start op for async pairs)
    is_async: bool = False
    op_name: str = ""  # metadata op_name, when present
    groups: tuple[tuple[int, ...], ...] | None = None  # device groups; None: one group of every device

    def spans(self, block: int) -> bool:
        """Whether a group mixes devices from different consecutive blocks of ``block`` ids.

        On a ``(replica, data)`` mesh of D data devices, ``op.spans(D)`` tells an op
        that crosses replicas from one that stays inside a replica.
        """
        if self.groups is None:
            return True
        return any(len({i // block for i in g}) > 1 for g in self.groups)

    def bytes_by_dtype(self) -> dict[str, float]:
        """``total_bytes`` split over the element types of the payload."""
        sizes = [array_bytes(d, s) for d, s in zip(self.dtypes, self.shapes)]
        tot = sum(sizes)
        out: dict[str, float] = {}
        for d, sz in zip(self.dtypes, sizes):
            share = self.total_bytes * (sz / tot) if tot else 0.0
            out[d] = out.get(d, 0.0) + share
        return out


def _fmt_shape(op: CollectiveOp) -> str:
    parts = [f"{d}[{','.join(map(str, s))}]" for d, s in zip(op.dtypes, op.shapes)]
    if len(parts) == 1:
        return f"[{','.join(map(str, op.shape))}]"
    if len(set(parts)) == 1:
        return f"{len(parts)}x[{','.join(map(str, op.shapes[0]))}]"
    return "(" + ", ".join(parts) + ")"


def _fmt_num(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def human_bytes(x: float) -> str:
    """``6144`` -> ``"6.00 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024.0
    return str(x)


def _select(ops: list[CollectiveOp], mode: str, depth: int = 0) -> list[CollectiveOp]:
    """Rows on the heaviest ("max") / lightest ("min") branch of each conditional."""
    if mode == "all":
        return list(ops)
    chosen = [op for op in ops if len(op.branch_path) == depth]
    conds: dict[str, list[CollectiveOp]] = {}
    nbranch: dict[str, int] = {}
    for op in ops:
        if len(op.branch_path) > depth:
            key, _, nb = op.branch_path[depth]
            conds.setdefault(key, []).append(op)
            nbranch[key] = nb
    for key, cops in conds.items():
        best: list[CollectiveOp] | None = None
        best_total = 0.0
        for b in range(nbranch[key]):
            sel = _select([op for op in cops if op.branch_path[depth][1] == b], mode, depth + 1)
            t = sum(op.total_bytes for op in sel)
            if best is None or (t > best_total if mode == "max" else t < best_total):
                best, best_total = sel, t
        chosen.extend(best or [])
    return chosen


@dataclasses.dataclass
class CollectiveReport:
    """All collectives of a program; bytes are per device per program run."""

    ops: list[CollectiveOp]
    module_name: str = ""
    replica_count: int = 1
    num_partitions: int = 1

    def _chosen(self, branches: str) -> list[CollectiveOp]:
        if branches not in ("max", "min", "all"):
            raise ValueError("branches must be 'max', 'min' or 'all'")
        return _select(self.ops, branches)

    @property
    def total(self) -> float:
        """Per-run upper bound: rows outside conditionals + heaviest branch of each."""
        return sum(op.total_bytes for op in self._chosen("max"))

    @property
    def total_min(self) -> float:
        """Per-run lower bound: rows outside conditionals + lightest branch of each."""
        return sum(op.total_bytes for op in self._chosen("min"))

    @property
    def total_all_branches(self) -> float:
        """Every row summed, all branches of every conditional (an over-count)."""
        return sum(op.total_bytes for op in self.ops)

    @property
    def has_unknown_trip_counts(self) -> bool:
        """True when some rows are per loop iteration (trip count unknown)."""
        return any(op.per_iteration for op in self.ops)

    def by_kind(self, branches: str = "max") -> dict[str, float]:
        """kind -> bytes; ``branches`` = "max" (sums to ``total``), "min" or "all"."""
        out: dict[str, float] = {}
        for op in self._chosen(branches):
            out[op.kind] = out.get(op.kind, 0.0) + op.total_bytes
        return out

    def by_dtype(self, branches: str = "max") -> dict[str, float]:
        """dtype -> bytes (tuple payloads split per element), same ``branches``."""
        out: dict[str, float] = {}
        for op in self._chosen(branches):
            for d, b in op.bytes_by_dtype().items():
                out[d] = out.get(d, 0.0) + b
        return out

    def filter(self, kind: str | None = None, dtype: str | None = None, min_bytes: float = 0) -> list[CollectiveOp]:
        """Rows of ``kind`` whose payload holds ``dtype`` and ``total_bytes >= min_bytes``."""
        out = []
        for op in self.ops:
            if kind is not None and op.kind != kind:
                continue
            if dtype is not None and dtype not in op.dtypes:
                continue
            if op.total_bytes < min_bytes:
                continue
            out.append(op)
        return out

    def table(self) -> str:
        """A readable multi-line table of all rows plus totals."""
        header = ("kind", "dtype", "shape", "group", "count", "bytes/dev", "total", "context")
        rows = [
            (
                op.kind + (" (async)" if op.is_async else ""),
                op.dtype,
                _fmt_shape(op),
                str(op.group_size),
                str(op.count) + ("/iter" if op.per_iteration else ""),
                _fmt_num(op.bytes_per_device),
                _fmt_num(op.total_bytes),
                op.context,
            )
            for op in self.ops
        ]
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
        right = {3, 4, 5, 6}

        def fmt(r: Iterable[str]) -> str:
            cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
            return "  ".join(cells).rstrip()

        lines = [fmt(header), fmt("-" * w for w in widths)]
        lines += [fmt(r) for r in rows]
        if not rows:
            lines.append("(no collectives)")
        tot, tmin = self.total, self.total_min
        lines.append(f"total per device per run: {_fmt_num(tot)} B ({human_bytes(tot)})")
        if tmin != tot:
            lines.append(
                f"  (upper bound: heaviest conditional branch; lightest-branch total {_fmt_num(tmin)} B ({human_bytes(tmin)}))"
            )
        if self.has_unknown_trip_counts:
            lines.append("  (rows marked /iter are per iteration of a loop with unknown trip count)")
        kinds = self.by_kind()
        if kinds:
            lines.append("by kind: " + ", ".join(f"{k} {_fmt_num(v)}" for k, v in sorted(kinds.items())))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# ---------------------------------------------------------------------------
# Walking the call graph
# ---------------------------------------------------------------------------


def collective_kind(opcode: str) -> tuple[str | None, bool]:
    """(normalized kind, is_async_start) for a collective opcode, else (None, False)."""
    if opcode in COLLECTIVE_KINDS:
        return opcode, False
    if opcode.endswith("-start") and opcode[: -len("-start")] in COLLECTIVE_KINDS:
        return opcode[: -len("-start")], True
    return None, False


def _has_collective(comp: Computation) -> bool:
    return any(collective_kind(i.opcode)[0] is not None for i in comp.instrs)


class _Walker:
    def __init__(self, module: ParsedModule):
        self.m = module
        self.ops: list[CollectiveOp] = []

    def run(self) -> list[CollectiveOp]:
        if self.m.entry is not None:
            self.walk(self.m.entry, 1, False, (), (), "", ())
        return self.ops

    def walk(self, cname, mult, per_iter, ctx, path, site, stack):
        comp = self.m.comps.get(cname)
        if comp is None or cname in stack:
            return
        stack = stack + (cname,)
        consumers: dict[str, Instruction] = {}
        for ins in comp.instrs:
            if ins.opcode.endswith("-done") or ins.opcode.endswith("-update"):
                for o in ins.operands[:1]:
                    consumers[o] = ins
        for ins in comp.instrs:
            kind, is_start = collective_kind(ins.opcode)
            here = f"{site}/{ins.name}" if site else ins.name
            if kind is not None:
                callee = computation_names(ins.attrs["calls"]) if "calls" in ins.attrs else []
                wrapped = [c for c in callee if c in self.m.comps and _has_collective(self.m.comps[c])]
                if is_start and wrapped:
                    for c in wrapped:
                        self.walk(c, mult, per_iter, ctx, path, here, stack)
                    continue
                self.emit(ins, kind, is_start, comp, consumers, mult, per_iter, ctx, path)
            elif ins.opcode == "while":
                self.walk_while(ins, mult, per_iter, ctx, path, here, stack)
            elif ins.opcode == "conditional":
                self.walk_branches(ins, mult, per_iter, ctx, path, here, stack)
            elif ins.opcode in self.CALLEES:
                for k in self.CALLEES[ins.opcode]:
                    for c in computation_names(ins.attrs.get(k, "")):
                        self.walk(c, mult, per_iter, ctx, path, here, stack)

    # the attributes naming the computations a call-like instruction runs once
    CALLEES = {"call": ("to_apply", "calls"), "fusion": ("calls",), "async-start": ("calls",),
               "custom-call": ("called_computations",)}

    def walk_while(self, ins, mult, per_iter, ctx, path, here, stack):
        """A ``while``'s body and condition, counted by its trip count (per iteration where unknown)."""
        n = trip_count(ins.attrs)
        if n is None:
            label, m2, p2 = "while body (trip count unknown, per iteration)", mult, True
            clabel, cm = "while condition (trip count unknown, per iteration)", mult
        else:
            label, m2, p2 = f"while body x{n}", mult * n, per_iter
            clabel, cm = f"while condition x{n + 1}", mult * (n + 1)
        for c in computation_names(ins.attrs.get("body", "")):
            self.walk(c, m2, p2, ctx + (label,), path, here, stack)
        for c in computation_names(ins.attrs.get("condition", "")):
            self.walk(c, cm, p2, ctx + (clabel,), path, here, stack)

    def walk_branches(self, ins, mult, per_iter, ctx, path, here, stack):
        """Each branch of a ``conditional``, its path noting which branch of how many."""
        if "branch_computations" in ins.attrs:
            branches = computation_names(ins.attrs["branch_computations"])
            labels = [str(i) for i in range(len(branches))]
        else:
            branches = computation_names(ins.attrs.get("true_computation", "")) + computation_names(
                ins.attrs.get("false_computation", ""))
            labels = ["0 (true)", "1 (false)"][: len(branches)]
        for i, (c, lab) in enumerate(zip(branches, labels)):
            self.walk(c, mult, per_iter, ctx + (f"conditional branch {lab} of {ins.name}",),
                      path + ((here, i, len(branches)),), here, stack)

    def emit(self, ins, kind, is_start, comp, consumers, mult, per_iter, ctx, path):
        shape_text = ins.shape
        if is_start:
            nxt = consumers.get(ins.name)
            seen = set()
            while nxt is not None and nxt.opcode.endswith("-update") and nxt.name not in seen:
                seen.add(nxt.name)
                nxt = consumers.get(nxt.name)
            if nxt is not None and nxt.opcode.endswith("-done"):
                shape_text = nxt.shape
            elif kind != "all-reduce":
                # start shapes are (operands, results[, context...]): take results
                elems = _tuple_elements(ins.shape)
                if len(elems) >= 2:
                    shape_text = elems[1]
        arrays = [(d, s) for d, s in parse_shapes(shape_text) if d not in ("token", "opaque")]
        if not arrays:
            return
        dtypes = tuple(d for d, _ in arrays)
        shapes = tuple(s for _, s in arrays)
        payload = sum(array_bytes(d, s) for d, s in arrays)
        n = _group_size(kind, ins.attrs, self.m.replica_count, self.m.num_partitions)
        per_dev = _ring_bytes(kind, n, payload)
        uniq = sorted(set(dtypes), key=dtypes.index)
        dtype = uniq[0] if len(uniq) == 1 else "mixed(" + ",".join(uniq) + ")"
        self.ops.append(
            CollectiveOp(
                kind=kind,
                dtype=dtype,
                shape=shapes[0],
                shapes=shapes,
                dtypes=dtypes,
                count=mult,
                group_size=n,
                payload_bytes=payload,
                bytes_per_device=per_dev,
                total_bytes=mult * per_dev,
                computation=comp.name,
                context=" > ".join(ctx) if ctx else "entry",
                per_iteration=per_iter,
                branch=f"{path[-1][0]}:{path[-1][1]}" if path else None,
                branch_path=path,
                name=ins.name,
                is_async=is_start,
                op_name=_op_name(ins),
                groups=replica_groups(ins.attrs.get("replica_groups")) if kind != "collective-permute" else None,
            )
        )


def _op_name(ins: Instruction) -> str:
    """The JAX source op an instruction came from (its metadata's ``op_name``), or ""."""
    om = re.search(r'op_name="((?:[^"\\]|\\.)*)"', ins.attrs.get("metadata", ""))
    return om.group(1) if om else ""


def _hlo_text(compiled: Any) -> str:
    if isinstance(compiled, str):
        return compiled
    try:
        from jax import stages

        if isinstance(compiled, stages.Lowered):
            compiled = compiled.compile()
    except ImportError:  # pragma: no cover
        pass
    if hasattr(compiled, "as_text"):
        text = compiled.as_text()
    elif hasattr(compiled, "as_hlo_text"):
        text = compiled.as_hlo_text()
    elif hasattr(compiled, "to_string"):
        text = compiled.to_string()
    else:
        raise TypeError(f"cannot get HLO text from {type(compiled).__name__}")
    if not isinstance(text, str) or "HloModule" not in text and "ENTRY" not in text:
        raise ValueError("object did not produce HLO module text")
    return text


def collective_bytes(compiled: Any) -> CollectiveReport:
    """Report the collectives of ``compiled`` and the bytes they move.

    ``compiled``: a ``jax.stages.Compiled`` (``.as_text()`` is parsed), a
    ``jax.stages.Lowered`` (compiled first), or an HLO module text string.
    Bytes are per device per run of the program; see the module docstring.
    """
    return _report_of_text(_hlo_text(compiled))


@functools.lru_cache(maxsize=32)
def _report_of_text(text: str) -> CollectiveReport:
    # parsing is pure Python (about 0.7 s for a small step program); a process that builds the same
    # program again (a resumed trainer, a test's second run) reads the report back
    module = parse_module(text)
    ops = _Walker(module).run()
    return CollectiveReport(
        ops=ops,
        module_name=module.name,
        replica_count=module.replica_count,
        num_partitions=module.num_partitions,
    )


# ---------------------------------------------------------------------------
# Order between collectives
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class UnorderedCollectives:
    """Two collectives (or calls, loops or branches holding collectives) of one computation that no chain
    of operands or control predecessors orders: a runtime may start either first."""

    computation: str
    first: str
    second: str
    first_op_name: str = ""
    second_op_name: str = ""

    def __str__(self) -> str:
        what = lambda name, op: f"{name} ({op})" if op else name
        return (f"in {self.computation}: {what(self.first, self.first_op_name)} and "
                f"{what(self.second, self.second_op_name)} are not ordered")


_CALLEE_KEYS = ("body", "condition", "branch_computations", "true_computation", "false_computation", "calls",
                "to_apply", "called_computations")


def ancestor_sets(preds: list[list[int]]) -> list[int]:
    """Per node of a DAG given by its predecessors' indices, the bit set of every node that reaches it
    (bit ``j`` set: node ``j`` is an ancestor), by an iterative depth-first walk."""
    ancestors: list[int | None] = [None] * len(preds)
    for root in range(len(preds)):
        stack = [root]
        while stack:
            i = stack[-1]
            if ancestors[i] is not None:
                stack.pop()
                continue
            missing = [p for p in preds[i] if ancestors[p] is None]
            if missing:
                stack.extend(missing)
                continue
            bits = 0
            for p in preds[i]:
                bits |= (ancestors[p] or 0) | (1 << p)
            ancestors[i] = bits
            stack.pop()
    return ancestors


def unordered_collectives(compiled: Any) -> list[UnorderedCollectives]:
    """Every pair of collectives of ``compiled`` that may run in either order.

    A runtime that schedules each device's copy of a program on its own may start two collectives that no
    data or control dependence orders in different orders on different devices, and then each device
    waits at a rendezvous the others never reach. A program needs no runtime guard against it when every
    pair of its collective *sites* is ordered (the trainer's programs compiled for CPU are:
    :func:`loco_jax.collectives.after` supplies the order there). In each computation reached from ENTRY,
    a site is a collective (or its async start), or a ``while``/``conditional``/``call``/
    ``async-start`` whose computations hold one (the pairs inside them are checked in turn). A pair is
    ordered when one site reaches the other through operands and ``control-predecessors``. Reduction
    computations (``to_apply`` of a reduce) and fusions hold no collectives and are not walked. A collective
    whose every replica group is one device (a reduction over an axis of size 1) waits for no other device
    and is not a site.

    ``compiled``: as for :func:`collective_bytes`. Returns an empty list for a program whose collectives
    run in one order on every device.
    """
    module = parse_module(_hlo_text(compiled), every_instruction=True)
    holds: dict[str, bool] = {}

    def callees(ins: Instruction) -> list[str]:
        if ins.opcode in ("fusion",) or collective_kind(ins.opcode)[0] is not None:
            return []
        return [c for k in _CALLEE_KEYS if k in ins.attrs for c in computation_names(ins.attrs[k]) if c in module.comps]

    def is_site(ins: Instruction) -> bool:
        kind, _ = collective_kind(ins.opcode)
        if kind is not None:
            return synchronizes(ins)
        if ins.opcode.endswith("-done") or ins.opcode.endswith("-update"):
            return False
        return any(comp_holds(c) for c in callees(ins))

    def synchronizes(ins: Instruction) -> bool:  # a collective whose every group is one device waits for no other
        groups = replica_groups(ins.attrs.get("replica_groups"))
        return ins.opcode == "collective-permute" or groups is None or any(len(g) > 1 for g in groups)

    def comp_holds(name: str, stack: tuple = ()) -> bool:
        if name not in holds:
            if name in stack:
                return False
            holds[name] = any((collective_kind(i.opcode)[0] is not None and synchronizes(i))
                              or any(comp_holds(c, stack + (name,)) for c in callees(i))
                              for i in module.comps[name].instrs)
        return holds[name]

    out: list[UnorderedCollectives] = []
    seen: set[str] = set()
    todo = [module.entry] if module.entry else []
    while todo:
        name = todo.pop()
        if name in seen or name not in module.comps:
            continue
        seen.add(name)
        comp = module.comps[name]
        index = {ins.name: i for i, ins in enumerate(comp.instrs)}
        preds = [[index[o] for o in ins.operands + computation_names(ins.attrs.get("control-predecessors", ""))
                  if o in index] for ins in comp.instrs]
        ancestors = ancestor_sets(preds)
        sites = [i for i, ins in enumerate(comp.instrs) if is_site(ins)]
        for a_pos, a in enumerate(sites):
            for b in sites[a_pos + 1:]:
                if not (ancestors[b] >> a) & 1 and not (ancestors[a] >> b) & 1:
                    ia, ib = comp.instrs[a], comp.instrs[b]
                    out.append(UnorderedCollectives(name, ia.name, ib.name, _op_name(ia), _op_name(ib)))
        for i in sites:
            todo.extend(callees(comp.instrs[i]))
    return out
