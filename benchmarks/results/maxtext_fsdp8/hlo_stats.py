"""Counts from an XLA after-optimizations HLO text dump: ops by opcode (executed counts: while bodies x trip
count), fusions by kind, dots by operand/result dtype with FLOPs, collectives with bytes and dtypes.
usage: python hlo_stats.py FILE.txt [--json]"""

import json
import re
import sys
from collections import Counter, defaultdict

DT = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8, "u64": 8, "f64": 8}
SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|s8|u8|pred|s64|u64|f64)\[([0-9,]*)\]")
INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")


def shapes(s):
    out = []
    for dt, dims in SHAPE.findall(s):
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        out.append((dt, n, dims))
    return out


def parse(path):
    comps, cur, entry = {}, None, None
    for line in open(path):
        if line.startswith("ENTRY") or re.match(r"^%?[\w.\-]+ .*\{\s*$", line) and "=" not in line.split("(")[0]:
            name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            name = name.lstrip("%")
            cur = comps.setdefault(name, [])
            if line.startswith("ENTRY"):
                entry = name
            continue
        if line.strip() == "}":
            cur = None
            continue
        if cur is None:
            continue
        m = INSTR.match(line)
        if not m:
            continue
        _, iname, typ, op, rest = m.groups()
        cur.append({"name": iname, "type": typ, "op": op, "rest": rest, "line": line})
    return comps, entry


def main(path, as_json=False):
    comps, entry = parse(path)
    byname = {i["name"]: i for c in comps.values() for i in c}
    mult = defaultdict(int)  # executions of each computation per step

    def walk(comp, k):
        mult[comp] += k
        for i in comps.get(comp, []):
            if i["op"] == "while":
                body = re.search(r"body=%?([\w.\-]+)", i["rest"])[1]
                cond = re.search(r"condition=%?([\w.\-]+)", i["rest"])[1]
                tc = re.search(r'"known_trip_count":\{"n":"(\d+)"', i["rest"])
                n = int(tc[1]) if tc else 1
                walk(body, k * n)
                walk(cond, k * (n + 1))
            elif i["op"] in ("call", "conditional"):
                for c in re.findall(
                    r"(?:to_apply|branch_computations=\{|true_computation|false_computation)=?%?([\w.\-]+)", i["rest"]
                ):
                    if c in comps:
                        walk(c, k)

    walk(entry, 1)
    ops, fus, dots, coll = Counter(), Counter(), Counter(), defaultdict(lambda: [0, 0])
    coll_list = []
    dot_flops = Counter()
    fused_dots = Counter()
    for comp, k in mult.items():
        for i in comps[comp]:
            op = i["op"]
            if op in ("parameter", "get-tuple-element", "tuple", "constant", "bitcast"):
                continue
            ops[op] += k
            if op == "fusion":
                kind = re.search(r"kind=(\w+)", i["rest"])[1]
                fk = re.search(r'"kind":"(\w+)"', i["rest"])
                fus[kind + (":" + fk[1] if fk else "")] += k
                called = re.search(r"calls=%?([\w.\-]+)", i["rest"])[1]
                for j in comps.get(called, []):
                    if j["op"] in ("dot", "convolution"):
                        fused_dots[_dot_key(j, byname, comps[called])] += k
                        dot_flops[_dot_key(j, byname, comps[called])] += k * _flops(j, comps[called])
            if op in ("dot", "convolution"):
                key = _dot_key(i, byname, comps[comp])
                dots[key] += k
                dot_flops[key] += k * _flops(i, comps[comp])
            if op.startswith(
                ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
            ) and not op.endswith("-done"):
                res = shapes(i["type"])
                b = sum(n * DT[dt] for dt, n, _ in res)
                dts = "+".join(sorted({dt for dt, _, _ in res}))
                key = f"{op} {dts}"
                coll[key][0] += k
                coll[key][1] += k * b
                coll_list.append({"op": op, "comp": comp, "times": k, "result": i["type"][:200], "bytes": b})
    out = {
        "file": path,
        "executed_ops_total": sum(ops.values()),
        "ops": dict(ops.most_common()),
        "fusions": dict(fus.most_common()),
        "dots_unfused": dict(dots),
        "dots_in_fusions": dict(fused_dots),
        "dot_gflops": {k: v / 1e9 for k, v in dot_flops.items()},
        "dot_gflops_total": sum(dot_flops.values()) / 1e9,
        "collectives": {k: {"count": v[0], "bytes": v[1]} for k, v in coll.items()},
        "collective_bytes_total": sum(v[1] for v in coll.values()),
        "collective_count_total": sum(v[0] for v in coll.values()),
        "collective_list": coll_list,
        "while_trip_counts": {c: k for c, k in mult.items() if k > 1},
    }
    if as_json:
        print(json.dumps(out, indent=1))
    else:
        for key in (
            "executed_ops_total",
            "ops",
            "fusions",
            "dots_unfused",
            "dots_in_fusions",
            "dot_gflops",
            "dot_gflops_total",
            "collectives",
            "collective_bytes_total",
            "collective_count_total",
        ):
            print(key, json.dumps(out[key]))
        for c in coll_list:
            print("  ", c["times"], "x", c["op"], c["bytes"], c["result"][:150])
    return out


def _operand_types(i, byname, comp):
    names = re.findall(r"%([\w.\-]+)", i["rest"].split(")")[0])
    local = {j["name"]: j for j in comp}
    return [(local.get(n) or byname.get(n, {"type": "?"}))["type"] for n in names[:2]]


def _dot_key(i, byname, comp):
    ts = _operand_types(i, byname, comp)
    od = [SHAPE.search(t)[1] if SHAPE.search(t) else "?" for t in ts]
    rd = SHAPE.search(i["type"])[1]
    return f"{'x'.join(od)}->{rd}"


def _flops(i, comp):
    # 2 * result elements * contracted size
    local = {j["name"]: j for j in comp}
    names = re.findall(r"%([\w.\-]+)", i["rest"].split(")")[0])
    lhs = local.get(names[0])
    res = shapes(i["type"])[0][1]
    cd = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", i["rest"])
    if not lhs or not cd:
        return 0
    ldims = [int(x) for x in SHAPE.search(lhs["type"])[2].split(",") if x]
    c = 1
    for d in cd[1].split(","):
        if d:
            c *= ldims[int(d)]
    return 2 * res * c


if __name__ == "__main__":
    main(sys.argv[1], "--json" in sys.argv)
