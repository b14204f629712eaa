"""What one run of an optimized HLO module moves and computes, read from its text (`compiled.as_text()`
or XLA's `*after_optimizations.txt` dump): collective bytes by kind and matmul FLOPs per device, with
loop bodies counted as often as their known trip count runs them. The one definition of "collective
bytes" that `python -m trainer inspect` and the CI budget test share.

Collective bytes of one op, per device: the all-gather's result; the all-reduce's, reduce-scatter's,
all-to-all's and collective-permute's operand (the full buffer each device contributes). Async pairs
count once (the `-start`); XLA's `async-start` wrappers are counted through the op in the computation
they call. Pure text: no jax here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_CALLS = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_PARAM = re.compile(r"([\w.\-]+):\s*(\([^)]*\)|[\w\[\]{},:]+)")
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))?"
    r"(?: \{([^}]*)\})?"
)
_IOTA_GROUPS = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_LIST_GROUPS = re.compile(r"(?:replica_groups|source_target_pairs)=\{(\{[0-9,]*\}(?:,\{[0-9,]*\})*)\}")


def shape_bytes(type_text: str) -> int:
    """Bytes of every array in an HLO type (a shape or a tuple of shapes)."""
    total = 0
    for dtype, dims in _SHAPE.findall(type_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
    return total


def _dims(type_text: str) -> list[int]:
    m = _SHAPE.search(type_text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


@dataclass
class _Instr:
    name: str
    type: str
    op: str
    operands: list[str]
    attrs: str


@dataclass
class _Computation:
    name: str
    instrs: list[_Instr] = field(default_factory=list)
    calls: list[tuple[str, int]] = field(default_factory=list)  # (callee, times per run of this computation)


def _split_args(rest: str) -> tuple[str, str]:
    """The operand list of `op(...)` and the attributes after it."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i], rest[i + 1 :]
    return rest, ""


def _parse(text: str) -> tuple[dict[str, _Computation], str, dict[str, str]]:
    comps: dict[str, _Computation] = {}
    types: dict[str, str] = {}  # instruction or parameter name -> its type (names are module-unique)
    entry, cur = "", None
    for line in text.splitlines():
        if cur is None:
            if (h := _HEADER.match(line)) is not None:
                cur = comps.setdefault(h.group(1), _Computation(h.group(1)))
                entry = h.group(1) if line.startswith("ENTRY") else entry
                types.update(_PARAM.findall(h.group(2)))
            continue
        if line.strip() == "}":
            cur = None
            continue
        if (m := _INSTR.match(line)) is None:
            continue
        name, typ, op, rest = m.groups()
        args, attrs = _split_args(rest)
        types[name] = typ
        cur.instrs.append(_Instr(name, typ, op, re.findall(r"%([\w.\-]+)", args), attrs))
        trip = int(t.group(1)) if op == "while" and (t := _TRIP.search(attrs)) else 1
        for role, callee in _CALLS.findall(attrs):
            cur.calls.append((callee, trip if role == "body" else 1))
        for b in _BRANCHES.findall(attrs):
            cur.calls.extend((c.strip().lstrip("%"), 1) for c in b.split(","))
    return comps, entry, types


def _multipliers(comps: dict[str, _Computation], entry: str) -> dict[str, int]:
    """How many times each computation runs per run of the entry computation (call graph is a DAG)."""
    order, seen = [], set()

    def visit(name: str) -> None:  # post-order: callees first
        if name in seen or name not in comps:
            return
        seen.add(name)
        for callee, _ in comps[name].calls:
            visit(callee)
        order.append(name)

    visit(entry)
    times = {name: 0 for name in order}
    times[entry] = 1
    for name in reversed(order):  # callers before callees
        for callee, k in comps[name].calls:
            if callee in times:
                times[callee] += times[name] * k
    return times


def _ints(text: str | None) -> list[int]:
    return [int(x) for x in text.split(",") if x] if text else []


def groups(attrs: str) -> list[list[int]] | None:
    """The device groups a collective runs over (logical device ids), from any of XLA's printed forms;
    None when not printed in a form known here."""
    import numpy as np  # numpy only: still no jax

    if m := _MESH_GROUPS.search(attrs):
        names = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        sizes = [int(v) for _, v in names]
        ids = np.arange(int(np.prod(sizes)))
        if m.group(2):
            ids = ids.reshape(_ints(m.group(2)))
            ids = ids.transpose(_ints(m.group(3))) if m.group(3) else ids
        ids = ids.reshape(sizes)
        over = re.findall(r"'(\w+)'", m.group(4)) if m.group(4) else [n for n, _ in names]
        axes = [i for i, (n, _) in enumerate(names) if n in over]
        rest = [i for i in range(len(sizes)) if i not in axes]
        return ids.transpose(rest + axes).reshape(-1, int(np.prod([sizes[i] for i in axes]))).tolist()
    if m := _IOTA_GROUPS.search(attrs):
        ids = np.arange(int(np.prod(_ints(m.group(2))))).reshape(_ints(m.group(2)))
        ids = ids.transpose(_ints(m.group(3))) if m.group(3) else ids
        return ids.reshape(_ints(m.group(1))).tolist()
    if m := _LIST_GROUPS.search(attrs):
        return [_ints(g) for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
    return None


def crosses_hosts(attrs: str, host_size: int) -> bool | None:
    """Whether some group of this collective holds devices of two hosts (host = id // host_size)."""
    g = groups(attrs)
    return None if g is None else any(len({d // host_size for d in grp}) > 1 for grp in g)


@dataclass
class StepStats:
    """Per device, per run of the module."""

    collective_bytes: dict[str, int]  # by kind
    collective_ops: dict[str, int]  # executed ops by kind (loop bodies times their trip count)
    inter_host_bytes: int  # the part of the collective bytes whose device groups span hosts (unknown: counted)
    matmul_flops: float  # 2 x M x N x K of every dot, loop bodies times their trip count
    unknown_trip_counts: int  # while loops without a known trip count (counted once)

    @property
    def total_collective_bytes(self) -> int:
        return sum(self.collective_bytes.values())


def _collective_kind(op: str) -> str | None:
    base = op[:-6] if op.endswith("-start") else op
    return base if base in KINDS else None


def _dot_flops(ins: _Instr, types: dict[str, str]) -> float:
    out = 1
    for d in _dims(ins.type):
        out *= d
    lhs = _dims(types.get(ins.operands[0], "")) if ins.operands else []
    m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
    k = 1
    for d in (int(x) for x in m.group(1).split(",") if x) if m else ():
        k *= lhs[d] if d < len(lhs) else 1
    return 2.0 * out * k


def analyze(text: str, host_size: int = 8) -> StepStats:
    """Per-device totals of one run of the module. `host_size`: devices per host, for `inter_host_bytes`."""
    comps, entry, types = _parse(text)
    times = _multipliers(comps, entry)
    nbytes = dict.fromkeys(KINDS, 0)
    nops = dict.fromkeys(KINDS, 0)
    flops = 0.0
    unknown = inter = 0
    for name, k in times.items():
        for ins in comps[name].instrs:
            if ins.op == "while" and not _TRIP.search(ins.attrs):
                unknown += 1
            if ins.op == "dot":
                flops += k * _dot_flops(ins, types)
            kind = _collective_kind(ins.op)
            if kind is None:
                continue
            operand = sum(shape_bytes(types.get(o, "")) for o in ins.operands)
            if kind == "all-gather":
                # all-gather-start's type is the tuple (operands, results): the gathered part is the rest.
                size = shape_bytes(ins.type) - (operand if ins.op.endswith("-start") else 0)
            else:
                size = operand
            nbytes[kind] += k * size
            nops[kind] += k
            inter += k * size if crosses_hosts(ins.attrs, host_size) is not False else 0
    return StepStats(nbytes, nops, inter, flops, unknown)
