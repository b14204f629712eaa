"""Mutation harness (not collected by pytest): plant one plausible bug at a time in a scratch copy of the
repository, run the tests that promise to catch it there, and print a table (mutation, test, caught?).

    python tests/mutate.py --jobs 2              # every mutation, two at a time (~20 min on 2 cores)
    python tests/mutate.py prng_key_not_restored data_cursor_off_by_one   # some of them
    python tests/mutate.py --list                # names only
    python tests/mutate.py --check               # no mutant run: tests, anchors and catches exist (~1 s)
    python tests/mutate.py --out benchmarks/results/mutations.md --jobs 2 # baseline first, then the table

Each mutation is a list of edits (file, old text, new text); the old text must occur exactly once, so the
harness fails loudly when the code it mutates has changed. An edit follows its code across a move: when the
named file no longer holds the old text, the one module under trainer/ that does is edited instead. Each
names the tests that should catch it and, in `catch`, the assertion designed to: a substring of the
test-suite statement the failure must be raised at (found from pytest's traceback, run with PYTHONPATH at
the copy: workers start from it too). Caught means
the designed assertion failed: an AssertionError (or pytest's `Failed` of a `pytest.raises` that did not
raise, or of a `pytest.fail`) raised by the test-suite statement that contains `catch` itself, the innermost
frame of the traceback. A test that fails any other way (another exception at that line, an assert deeper in
the trainer, another statement, a fixture broke) counts as incidental, not caught: the designed assertion
might be dead. `--baseline` (implied by `--out`) first runs every named test on an unmutated copy and stops
unless all pass. `--check` (and tests/test_mutations.py) checks every mutation statically: its tests exist,
its edits apply, its `catch` is in its test files.

Each mutant's pytest runs in its own session (process group) with the copy's path in its environment; when it
ends, or times out, the whole group is killed and so is every process that carries the copy's path (in its
environment, command line or working directory): the daemons of a private SLURM cluster
(tests/slurm_cluster.py starts them in sessions of their own), their job steps and tasks (found by the
cluster's marker variable), trainer workers. The /etc/hosts lines and munge socket folder of such a cluster go
with them. The mutant's table row reads "timeout" and nothing of it is left running.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mutations import MUTATIONS, Mutation  # tests/ is on sys.path: this file runs as a script

ROOT = Path(__file__).resolve().parents[1]
COPY = ("trainer", "tests", "configs", "launch", "benchmarks", "pyproject.toml", "README.md")


def _copy(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache", "runs")
    for name in COPY:
        src = ROOT / name
        (shutil.copytree(src, dest / name, ignore=ignore) if src.is_dir() else shutil.copy2(src, dest / name))


def _locate(root: Path, file: str, old: str) -> str:
    """The file an edit applies to: the one it names while that holds the old text, else the one module under
    trainer/ that does (so an anchor follows its code when a module moves or is renamed); the named file
    when none or several do (the caller then reports the anchor as moved)."""
    named = root / file
    if not file.startswith("trainer/") or (named.is_file() and old in named.read_text()):
        return file
    hits = [p.relative_to(root).as_posix() for p in sorted((root / "trainer").rglob("*.py")) if old in p.read_text()]
    return hits[0] if len(hits) == 1 else file


def edited_files(m: Mutation, root: Path) -> list[str]:
    """The files m's edits apply to, found by content (_locate)."""
    return [_locate(root, file, old) for file, old, _ in m.edits]


def _plant(m: Mutation, root: Path) -> tuple[dict[str, str], list[str]]:
    """The mutated text of each file m edits (found under root by content: _locate) and what is wrong with
    m's edits: an old text that does not occur exactly once (after the edits before it), a mutant that does
    not parse."""
    read: Callable[[str], str] = lambda f: (root / f).read_text()  # noqa: E731
    texts: dict[str, str] = {}
    problems: list[str] = []
    for (_, old, new), file in zip(m.edits, edited_files(m, root), strict=True):
        if file not in texts:
            try:
                texts[file] = read(file)
            except OSError as e:
                problems.append(f"{m.name}: cannot read {file}: {e}")
                continue
        n = texts[file].count(old)
        if n != 1:
            problems.append(f"{m.name}: {old!r} occurs {n} times in {file} (expected once): the code moved")
            continue
        if old == new:
            problems.append(f"{m.name}: an edit of {file} changes nothing")
        texts[file] = texts[file].replace(old, new)
    for file, text in texts.items():
        if file.endswith(".py"):
            try:  # a mutant that does not parse would be "caught" by anything
                compile(text, file, "exec")
            except SyntaxError as e:
                problems.append(f"{m.name}: the mutant of {file} does not parse: {e}")
    return texts, problems


def _apply(dest: Path, m: Mutation) -> None:
    texts, problems = _plant(m, dest)
    if problems:
        raise SystemExit("\n".join(problems) + "\nupdate tests/mutations.py")
    for file, text in texts.items():
        (dest / file).write_text(text)


MARK = "TRAINER_MUTANT_COPY"  # every process of a mutant's run inherits it: the copy's path


def _ours(dest: Path, clusters: set[str], sockets: set[str] | None = None) -> list[int]:
    """Live processes (not this one) of the run in the copy at dest: the copy's path in their environment (MARK),
    command line or working directory, or the marker of a private SLURM cluster (tests/slurm_cluster.py) one of
    them served (slurmstepd keeps that marker, not the rest of the environment). Adds the clusters found, and
    to `sockets` the private socket folders (/tmp/lslurm-*) of their munged."""
    mark, path = f"{MARK}={dest}".encode(), str(dest).encode()
    procs: dict[int, tuple[bool, str | None, bytes]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            cwd = os.readlink(f"/proc/{pid}/cwd").encode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z":
            continue
        marked = mark in env or path in cmd or cwd == path or cwd.startswith(path + b"/")
        cluster = next((v.split(b"=", 1)[1].decode() for v in env if v.startswith(b"LOCAL_SLURM_CLUSTER_ID=")), None)
        procs[int(pid)] = (marked, cluster, cmd)
    clusters |= {c for marked, c, _ in procs.values() if marked and c}
    ours = sorted(pid for pid, (marked, c, _) in procs.items() if marked or c in clusters)
    for pid in ours if sockets is not None else ():
        if m := re.search(rb"--socket=(/tmp/lslurm-[^/\0]+)/", procs[pid][2]):
            sockets.add(m.group(1).decode())
    return ours


def _teardown(dest: Path, pgid: int | None, timeout: float = 15) -> list[int]:
    """Kill the run's process group and every process that belongs to its copy (daemons of its SLURM clusters
    run in sessions of their own, their job steps and tasks are re-parented to init) until none is left; drop
    the /etc/hosts lines and munge socket folders of its clusters. Returns the pids killed."""
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    killed: set[int] = set()
    clusters: set[str] = set()
    sockets: set[str] = set()
    deadline = time.monotonic() + timeout
    while (left := _ours(dest, clusters, sockets)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        time.sleep(0.2)
    for folder in sockets:  # munged's: tests/slurm_cluster.py removes it when it tears its cluster down
        shutil.rmtree(folder, ignore_errors=True)
    if clusters:
        try:
            from slurm_cluster import _HOSTS, _hosts_locked

            with _hosts_locked(), contextlib.suppress(OSError):
                lines = _HOSTS.read_text().splitlines(keepends=True)
                kept = [ln for ln in lines if not any(ln.rstrip().endswith(f"# local_slurm {c}") for c in clusters)]
                if kept != lines:
                    with open(_HOSTS, "w") as f:  # in place: /etc/hosts may be a bind mount
                        f.write("".join(kept))
        except ImportError:
            pass
    return sorted(killed)


def _pytest(dest: Path, tests: tuple[str, ...], timeout: float, *extra: str) -> tuple[Path | None, float]:
    """Run the tests in the copy at dest, in a session of their own; (junit report or None on timeout, seconds).
    Whatever the run leaves (on a timeout: pytest, its workers, SLURM daemons, trainer processes) is killed."""
    xml = dest / "junit.xml"
    xml.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(dest), PYTHONUNBUFFERED="1", **{MARK: str(dest)})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", f"--junitxml={xml}"]
    t0 = time.time()
    proc = subprocess.Popen(
        [*cmd, *extra, *tests],
        cwd=dest,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: a timeout kills the group, not only pytest
    )
    try:
        proc.wait(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    secs = time.time() - t0
    _teardown(dest, proc.pid)
    proc.wait()
    if timed_out:
        return None, secs
    return (xml if xml.is_file() else None), secs


def _statement(dest: Path, file: str, line: int) -> str:
    """The innermost simple statement of the test suite's file at line (a compound one's header line)."""
    src = (dest / file).read_text()
    inner = None
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if not isinstance(node, (ast.FunctionDef, ast.With, ast.For, ast.If, ast.Try, ast.While)):
                if inner is None or node.lineno >= inner.lineno:
                    inner = node
    text = ast.get_source_segment(src, inner) if inner is not None else src.splitlines()[line - 1]
    return " ".join((text or "").split())


def _judge(dest: Path, kind: str, message: str, report: str, catch: str) -> tuple[bool, str]:
    """Did the designed assertion fail? (yes/no, where: "file:line statement" of the innermost frame in the
    test suite, and where the exception was raised when deeper). From pytest's short traceback: its frames
    read "path:line: in function", innermost last; its exception is the first "E   " line (a rewritten assert
    without a message reads "assert ...")."""
    frames = re.findall(r"^(\S[^\n]*?\.py):(\d+): in ", report, re.M)
    ours = [(f, int(n)) for f, n in frames if f.startswith("tests/")]
    if not ours:
        return False, f"raised at {frames[-1][0]}:{frames[-1][1]}" if frames else ""
    file, line = ours[-1]
    stmt = _statement(dest, file, line)
    where = f"{file}:{line} {stmt}"
    raised_here = frames[-1] == (file, str(line))
    if not raised_here:
        where += f" (raised in {frames[-1][0]}:{frames[-1][1]})"
    first = next((ln[1:].strip() for ln in report.splitlines() if ln.startswith("E ")), message.strip())
    exc = "AssertionError" if first.startswith("assert ") else first.split(":", 1)[0].strip()
    designed = exc == "AssertionError" or (
        exc == "Failed" and ("DID NOT RAISE" in first or "pytest.fail(" in stmt)  # pytest.raises / pytest.fail
    )
    return kind == "failure" and raised_here and designed and bool(catch) and catch in stmt, where


def run(m: Mutation, timeout: float) -> list[tuple[str, str, float, str, str]]:
    """(test, outcome, seconds, where, why) for each test of the mutation. outcome: caught (an AssertionError
    raised by the statement the mutation names in `catch`, see _judge) | incidental (failed another way: another
    exception, another statement, an assert deeper in the code, a setup error) | MISSED (passed) | timeout |
    error; where: file:line and statement it failed at; why: the first line of the failure."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as d:
        dest = Path(d)
        _copy(dest)
        _apply(dest, m)
        xml, secs = _pytest(dest, m.tests, timeout)
        if xml is None:
            why = f"still running after {timeout:.0f}s" if secs >= timeout else "pytest wrote no report"
            return [(t, "timeout" if secs >= timeout else "error", secs, "", why) for t in m.tests]
        out = []
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            bad = case.find("failure")
            bad = bad if bad is not None else case.find("error")
            if bad is None:
                out.append((name, "MISSED", float(case.get("time", 0)), "", ""))
                continue
            designed, where = _judge(dest, bad.tag, bad.get("message") or "", bad.text or "", m.catch)
            where = where if len(where) <= 200 else where[:197] + "..."
            why = " ".join((bad.get("message") or "").split())[:120]
            out.append((name, "caught" if designed else "incidental", float(case.get("time", 0)), where, why))
        return out or [(t, "error", secs, "", "no test ran") for t in m.tests]


class _Unknown(Exception):
    """A parametrize argument this reader cannot work out without importing the test module."""


def _value(node: ast.AST, names: dict[str, ast.AST]):
    """A parametrize argument's value, read from the test module's source (literals, module-level names, dict
    keys, sorted/list/tuple, pytest.param); _Unknown for anything else."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_value(e, names) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_value(k, names): None for k in node.keys if k is not None}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand, names)
    if isinstance(node, ast.Name) and node.id in names:
        return _value(names[node.id], names)
    if isinstance(node, ast.Call) and not node.keywords and isinstance(node.func, ast.Name):
        fn = {"sorted": sorted, "list": list, "tuple": list}.get(node.func.id)
        if fn is not None and len(node.args) == 1:
            return fn(_value(node.args[0], names))
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.param":
        ids = [k.value for k in node.keywords if k.arg == "id"]
        return ("param", [_value(a, names) for a in node.args], _value(ids[0], names) if ids else None)
    raise _Unknown(ast.unparse(node))


def _param_id(value, argname: str, idx: int) -> str:
    """pytest's id of one argument value (its _idval for the kinds _value reads)."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, (bool, int, float, complex)):
        return str(value)
    return f"{argname}{idx}"


def _ids(fn: ast.FunctionDef, names: dict[str, ast.AST]) -> list[str] | None:
    """The ids pytest gives the function's parametrized cases (None: not parametrized); _Unknown when they
    cannot be read from the source."""
    layers = []
    for dec in reversed(fn.decorator_list):  # the one nearest the function is applied first: its id comes first
        if not (isinstance(dec, ast.Call) and ast.unparse(dec.func).endswith("mark.parametrize")):
            continue
        argnames = _value(dec.args[0], names)
        argnames = [a.strip() for a in argnames.split(",") if a.strip()] if isinstance(argnames, str) else argnames
        values = _value(dec.args[1] if len(dec.args) > 1 else dec.keywords[0].value, names)
        explicit = [k.value for k in dec.keywords if k.arg == "ids"]
        explicit = _value(explicit[0], names) if explicit else None
        layer = []
        for i, v in enumerate(values):
            given = None
            if isinstance(v, tuple) and v and v[0] == "param":
                _, v, given = v
                v = v if len(argnames) > 1 else v[0]
            if explicit is not None and explicit[i] is not None:
                given = explicit[i]
            vals = v if len(argnames) > 1 else [v]
            layer.append(given if given is not None else "-".join(_param_id(x, a, i) for x, a in zip(vals, argnames)))
        if len(set(layer)) != len(layer):
            raise _Unknown("duplicate ids (pytest suffixes them)")
        layers.append(layer)
    if not layers:
        return None
    out = [""]
    for layer in layers:
        out = [f"{a}-{b}" if a else b for b in layer for a in out]
    return out


def _collected(root: Path, file: str) -> set[str]:
    """Node ids pytest collects from one test file (the slow path: imports the module)."""
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", file],
        cwd=root,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(root)),
    )
    return {ln.strip() for ln in res.stdout.splitlines() if ln.startswith(file + "::")}


def _node_ids_exist(root: Path, ids: set[str]) -> list[str]:
    """The ids among these that name no test: read from the test modules' source (functions, classes'
    methods, parametrize ids); a file where the source cannot settle an id is collected by pytest instead."""
    missing, slow = [], set()
    by_file: dict[str, list[str]] = {}
    for node_id in ids:
        by_file.setdefault(node_id.split("::")[0], []).append(node_id)
    for file, wanted in sorted(by_file.items()):
        path = root / file
        if not path.is_file():
            missing += [f"{i}: no file {file}" for i in wanted]
            continue
        tree = ast.parse(path.read_text())
        names = {
            t.id: node.value
            for node in tree.body
            if isinstance(node, ast.Assign)
            for t in node.targets
            if isinstance(t, ast.Name)
        }
        funcs: dict[str, ast.FunctionDef] = {}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs[node.name] = node
            elif isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        funcs[f"{node.name}::{sub.name}"] = sub
        for node_id in sorted(wanted):
            rest = node_id.split("::", 1)[1] if "::" in node_id else ""
            func, _, param = rest.partition("[")
            fn = funcs.get(func)
            if fn is None or not func.split("::")[-1].startswith("test"):
                missing.append(f"{node_id}: no test {func or '(none)'} in {file}")
                continue
            if not param:
                continue
            try:
                ids = _ids(fn, names)
            except (_Unknown, IndexError, TypeError, AttributeError):
                slow.add(file)
                continue
            if ids is None or param[:-1] not in ids:
                slow.add(file)  # fixture params, pytest_generate_tests, ...: ask pytest before calling it gone
    for file in sorted(slow):
        collected = _collected(root, file)
        missing += [f"{i}: pytest does not collect it" for i in by_file[file] if "[" in i and i not in collected]
    return missing


def untouched(root: Path = ROOT) -> list[str]:
    """The trainer's modules (package __init__ and __main__ files aside) that no mutation edits."""
    edited = {file for m in MUTATIONS for file in edited_files(m, root)}
    mods = (p.relative_to(root).as_posix() for p in sorted((root / "trainer").rglob("*.py")))
    return [f for f in mods if f not in edited and not f.endswith(("/__init__.py", "/__main__.py"))]


def problems(mutations: list[Mutation], root: Path = ROOT) -> list[str]:
    """What is wrong with the mutations without running any: a duplicate name, no test or no `catch`, a test
    node id that names no test, an edit whose old text does not occur exactly once in its file (after the
    edits before it) or whose mutant does not parse, a `catch` found in none of the test files it names."""
    out = []
    seen: set[str] = set()
    for m in mutations:
        if m.name in seen:
            out.append(f"{m.name}: the name is used twice")
        seen.add(m.name)
        if not m.tests:
            out.append(f"{m.name}: names no test")
        if not m.catch:
            out.append(f"{m.name}: no designed assertion (catch=...)")
        out += _plant(m, root)[1]
        files = {t.split("::")[0] for t in m.tests}
        sources = [(root / f).read_text() for f in files if (root / f).is_file()]
        if m.catch and sources and not any(m.catch in src for src in sources):
            out.append(f"{m.name}: catch {m.catch!r} occurs in none of {', '.join(sorted(files))}")
    ids = {t for m in mutations for t in m.tests}
    where = {t: m.name for m in mutations for t in m.tests}
    out += [f"{where[i.split(': ')[0]]}: {i}" for i in _node_ids_exist(root, ids)]
    return out


def baseline(chosen: list[Mutation], timeout: float, workers: int) -> tuple[int, int, float]:
    """Run every test the chosen mutations name on an unmutated copy: (passed, failed, seconds), each failure
    named on stdout with its first line. A mutation table means something only on a green baseline."""
    tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
    with tempfile.TemporaryDirectory(prefix="mutant-baseline-") as d:
        dest = Path(d)
        _copy(dest)
        xml, secs = _pytest(dest, tests, timeout, "-n", str(workers), "--dist", "loadfile")
        if xml is None:
            return 0, len(tests), secs
        cases = list(ET.parse(xml).getroot().iter("testcase"))
        bad = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
        for c in bad:
            why = (c.find("failure") if c.find("failure") is not None else c.find("error")).get("message") or ""
            print(f"baseline failed: {c.get('classname')}::{c.get('name')}: {why.splitlines()[0] if why else ''}")
        return len(cases) - len(bad), len(bad) + max(0, len(tests) - len(cases)), secs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="mutations to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--check", action="store_true", help="check the mutations statically (no mutant runs) and exit")
    p.add_argument("--out", help="also write the table (markdown) here; implies --baseline")
    p.add_argument("--baseline", action="store_true", help="first run the tests unmutated; stop unless all pass")
    p.add_argument("--jobs", type=int, default=1, help="mutations run at once")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per mutation")
    args = p.parse_args()
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:38} {m.what}")
        return 0
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    if args.check or chosen:
        if found := problems(chosen):
            raise SystemExit("\n".join([*found, f"{len(found)} problem(s) in tests/mutations.py: fix them first"]))
        if args.check:
            print(f"{len(chosen)} mutations: their tests exist, their edits apply, their catches are in their tests")
            print(f"modules of trainer/ no mutation touches: {', '.join(untouched()) or 'none'}")
            return 0
    if unknown := set(args.names) - {m.name for m in MUTATIONS}:
        raise SystemExit(f"unknown mutation(s): {', '.join(sorted(unknown))} (see --list)")
    if nameless := [m.name for m in chosen if not m.catch]:
        raise SystemExit(f"mutation(s) without a designed assertion (catch=...): {', '.join(nameless)}")
    head = []
    if args.baseline or args.out:
        ok, failed, secs = baseline(chosen, args.timeout * 2, workers=3)
        head = [f"Baseline (unmutated copy, the same tests, `-n 3`): {ok} passed, {failed} failed, {secs:.0f} s.", ""]
        print(head[0], flush=True)
        if failed:
            print("baseline is not green: no mutation table")
            return 1
    rows, bad = [], []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for m, results in zip(chosen, pool.map(lambda m: run(m, args.timeout), chosen)):
            for test, outcome, secs, where, why in results:
                cells = [c.replace("|", "/").replace("`", "'") for c in (where, why)]
                catch = m.catch.replace("|", "\\|")  # a table cell: GitHub reads an escaped bar even in code
                rows.append(
                    f"| `{m.name}` | {m.what.replace('|', '/')} | `{test}` | {outcome} | `{catch}` | {cells[0]} "
                    f"| {secs:.0f} | {cells[1]} |"
                )
                print(rows[-1], flush=True)
            if any(outcome != "caught" for _, outcome, *_ in results):
                bad.append(m.name)
    table = [
        "| mutation | the bug | test | outcome | designed assertion | failed at | test s | first line |",
        "|---|---|---|---|---|---|---:|---|",
        *rows,
    ]
    print("\n".join(table))
    caught = len(chosen) - len(bad)
    print(f"{caught}/{len(chosen)} mutations caught by their designed assertion")
    if args.out:
        cmd = "python tests/mutate.py " + " ".join(sys.argv[1:])
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *COPY], cwd=ROOT, capture_output=True, text=True)
        tree = "with uncommitted changes" if dirty.stdout.strip() else "working tree clean"
        Path(args.out).write_text(
            f"# Mutations\n\nCommand: `{cmd}` at commit {commit.stdout.strip()} ({tree}).\n"
            "A mutation is caught when every test it names fails with an AssertionError raised by the statement"
            " named in `catch` (tests/mutations.py); a failure any other way is incidental.\n\n"
            + "\n".join(head)
            + f"{caught}/{len(chosen)} caught by their designed assertion.\n\n"
            + f"Modules of trainer/ no mutation touches: {', '.join(untouched()) or 'none'}.\n\n"
            + "\n".join(table)
            + "\n"
        )
    if bad:
        print(f"not caught by the designed assertion: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
