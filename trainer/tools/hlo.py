"""What one run of an optimized HLO module moves and computes, read from its text (`compiled.as_text()`
or XLA's `*after_optimizations.txt` dump): collective bytes by kind, and every matmul with its operand
dtypes and FLOPs per device, with loop bodies counted as often as their known trip count runs them. The one
definition of "collective bytes" that `python -m trainer inspect` and the CI budget test share.

Matmuls: `dot`s (also inside fusions: XLA:CPU's, and XLA:GPU's Triton and cuDNN GEMM fusions, whose called
computation holds the dot) and XLA:GPU's library calls, a `custom-call` to cuBLAS (`__cublas$gemm`,
`__cublas$lt$matmul`, `__cublas$lt$matmul$f8`, ...) whose contracting dims are in its backend_config.
cuDNN's fused attention (`__cudnn$fmha...`) is counted apart, by target: it is attention, not a GEMM.

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
_CONTRACT_ATTR = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_CONTRACT_JSON = re.compile(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
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


def _dtype(type_text: str) -> str:
    m = _SHAPE.search(type_text)
    return m.group(1) if m else "?"


def is_matmul_call(target: str) -> bool:
    """A custom call that is a GEMM: cuBLAS's (and hipBLAS's, which XLA names the same) plain and Lt calls,
    the f8 and other Lt variants included; not its triangular solve or LU (`__cublas$triangularSolve`, ...)."""
    return target == "__cublas$gemm" or target.startswith("__cublas$lt$matmul")


def is_attention_call(target: str) -> bool:
    """cuDNN's fused attention, forward and backward (`__cudnn$fmhaSoftmax`, `...Backward`, `...F8`, ...)."""
    return target.startswith("__cudnn$fmha")


@dataclass
class _Instr:
    name: str
    type: str
    op: str
    operands: list[str]
    attrs: str
    args: str = ""  # the text inside op(...): a parameter's index


@dataclass
class _Computation:
    name: str
    instrs: list[_Instr] = field(default_factory=list)
    calls: list[tuple[str, int]] = field(default_factory=list)  # (callee, times per run of this computation)
    root: str = ""


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
        cur.instrs.append(_Instr(name, typ, op, re.findall(r"%([\w.\-]+)", args), attrs, args))
        cur.root = name if line.lstrip().startswith("ROOT") else cur.root
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


@dataclass(frozen=True)
class Matmul:
    """One matmul instruction of the module (per device)."""

    op: str  # "dot", or the custom call's target ("__cublas$lt$matmul", ...)
    shape: tuple[int, ...]  # its result
    operands: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of lhs and rhs
    flops: float  # 2 x result elements x contracted size, one execution
    times: int  # executions per run of the module (loop bodies times their trip count)
    phase: str  # "forward" / "backward" from its op_name (jax's jvp / transpose), "" when it says neither
    program_dtypes: tuple[str, ...] = ()  # lhs's and rhs's before the converts XLA added (`_Upcasts`)

    @property
    def operand_dtypes(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.operands)

    @property
    def upcast_by_xla(self) -> bool:
        return bool(self.program_dtypes) and self.program_dtypes != self.operand_dtypes


@dataclass
class StepStats:
    """Per device, per run of the module."""

    collective_bytes: dict[str, int]  # by kind
    collective_ops: dict[str, int]  # executed ops by kind (loop bodies times their trip count)
    inter_host_bytes: int  # the part of the collective bytes whose device groups span hosts (unknown: counted)
    matmul_flops: float  # 2 x M x N x K of every matmul (dots and cuBLAS calls), times its executions
    unknown_trip_counts: int  # while loops without a known trip count (counted once)
    matmuls: list[Matmul] = field(default_factory=list)
    attention_calls: dict[str, int] = field(default_factory=dict)  # cuDNN fused attention: target -> executions

    @property
    def total_collective_bytes(self) -> int:
        return sum(self.collective_bytes.values())

    def matmul_flops_by_dtypes(self) -> dict[str, float]:
        """Matmul FLOPs by the program's operand dtypes ("bf16 x bf16": ...; before XLA:CPU's own upcasts):
        what a GPU runs at which tensor-core rate."""
        out: dict[str, float] = {}
        for mm in self.matmuls:
            key = " x ".join(mm.program_dtypes or mm.operand_dtypes)
            out[key] = out.get(key, 0.0) + mm.flops * mm.times
        return out


def _collective_kind(op: str) -> str | None:
    base = op[:-6] if op.endswith("-start") else op
    return base if base in KINDS else None


_WIDER = {"f32": ("bf16", "f16")}  # a convert to the key from one of these widens
_SAME_DTYPE = ("bitcast", "copy", "transpose", "reshape")


class _Upcasts:
    """The dtype a value had before the converts XLA added itself. XLA:CPU runs a bf16 x bf16 -> bf16 dot
    as an f32 dot between converts (a bf16 x bf16 -> f32 dot it keeps): its converts carry no op metadata,
    the program's own (jax's convert_element_type) do. A GPU keeps such a dot in bf16, so the program's
    dtype is the one that says what a GPU's matmul takes. Followed through fusions (a fused computation's
    parameter to its caller's operand, a fusion's result to its root) and dtype-preserving ops."""

    def __init__(self, comps: dict[str, _Computation], types: dict[str, str]):
        self.types = types
        self.defs: dict[str, tuple[_Instr, str]] = {}
        self.callers: dict[str, _Instr] = {}  # fused computation -> the fusion that calls it
        for comp in comps.values():
            for ins in comp.instrs:
                self.defs[ins.name] = (ins, comp.name)
                if ins.op == "fusion" and (c := re.search(r"\bcalls=%?([\w.\-]+)", ins.attrs)):
                    self.callers[c.group(1)] = ins
        self.roots = {name: comp.root for name, comp in comps.items()}

    def dtype(self, name: str, depth: int = 0) -> str:
        own = _dtype(self.types.get(name, ""))
        ins, comp = self.defs.get(name, (None, ""))
        if ins is None or depth > 64:
            return own
        nxt = None
        if ins.op == "convert" and "op_name=" not in ins.attrs and ins.operands:
            src = _dtype(self.types.get(ins.operands[0], ""))
            nxt = ins.operands[0] if src in _WIDER.get(own, ()) else None
        elif ins.op in _SAME_DTYPE and ins.operands:
            nxt = ins.operands[0]
        elif ins.op == "fusion" and (c := re.search(r"\bcalls=%?([\w.\-]+)", ins.attrs)):
            nxt = self.roots.get(c.group(1)) or None
        elif ins.op == "parameter" and comp in self.callers and ins.args.strip().isdigit():
            operands = self.callers[comp].operands
            i = int(ins.args)
            nxt = operands[i] if i < len(operands) else None
        if nxt is None:
            return own
        before = self.dtype(nxt, depth + 1)
        return before if before in _WIDER.get(own, ()) else own


def _matmul(ins: _Instr, op: str, types: dict[str, str], times: int, upcasts: _Upcasts) -> Matmul:
    """A dot's or a cuBLAS call's record. The call's result is a tuple (the product, then cuBLAS's workspace):
    its first array is the product; its contracting dims are in its backend_config's dot_dimension_numbers.
    Its operands after lhs and rhs (a bias, the f8 scales) take no part in the FLOPs."""
    shape = tuple(_dims(ins.type))
    operands = tuple((_dtype(types.get(o, "")), tuple(_dims(types.get(o, "")))) for o in ins.operands[:2])
    m = _CONTRACT_ATTR.search(ins.attrs) if op == "dot" else _CONTRACT_JSON.search(ins.attrs)
    lhs = operands[0][1] if operands else ()
    k = 1
    for d in (int(x.strip().strip('"')) for x in m.group(1).split(",") if x.strip()) if m else ():
        k *= lhs[d] if d < len(lhs) else 1
    out = 1
    for d in shape:
        out *= d
    name = (n.group(1) if (n := _OP_NAME.search(ins.attrs)) else "").split("/")
    # jax names the backward pass's ops transpose(jvp(...)), the forward's jvp(...); remat's recompute is
    # forward work that runs in the backward: its op_name says jvp, so it is counted forward.
    phase = "backward" if any(p.startswith("transpose(") for p in name) else ""
    phase = phase or ("forward" if any(p.startswith("jvp(") for p in name) else "")
    program = tuple(upcasts.dtype(o) for o in ins.operands[:2])
    return Matmul(op, shape, operands, 2.0 * out * k, times, phase, program)


def analyze(text: str, host_size: int = 8) -> StepStats:
    """Per-device totals of one run of the module. `host_size`: devices per host, for `inter_host_bytes`."""
    comps, entry, types = _parse(text)
    upcasts = _Upcasts(comps, types)
    times = _multipliers(comps, entry)
    nbytes = dict.fromkeys(KINDS, 0)
    nops = dict.fromkeys(KINDS, 0)
    matmuls: list[Matmul] = []
    attention: dict[str, int] = {}
    unknown = inter = 0
    for name, k in times.items():
        for ins in comps[name].instrs:
            if ins.op == "while" and not _TRIP.search(ins.attrs):
                unknown += 1
            if ins.op == "dot":
                matmuls.append(_matmul(ins, "dot", types, k, upcasts))
            elif ins.op == "custom-call" and (t := _TARGET.search(ins.attrs)):
                if is_matmul_call(t.group(1)):
                    matmuls.append(_matmul(ins, t.group(1), types, k, upcasts))
                elif is_attention_call(t.group(1)):
                    attention[t.group(1)] = attention.get(t.group(1), 0) + k
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
    flops = sum(mm.flops * mm.times for mm in matmuls)
    return StepStats(nbytes, nops, inter, flops, unknown, matmuls, attention)
