"""Mutation harness (not collected by pytest): plant one plausible bug at a time in a scratch copy of the
repository, run the tests that promise to catch it there, and print a table (mutation, test, caught?).

    python tests/mutate.py --jobs 2              # every mutation, two at a time (~20 min on 2 cores)
    python tests/mutate.py prng_key_not_restored data_cursor_off_by_one   # some of them
    python tests/mutate.py --list                # names only
    python tests/mutate.py --out benchmarks/results/mutations.md --jobs 2 # baseline first, then the table

Each mutation is a list of edits (file, old text, new text); the old text must occur exactly once, so the
harness fails loudly when the code it mutates has moved. Each names the tests that should catch it and, in
`catch`, the assertion designed to: a substring of the test-suite statement the failure must be raised at
(found from pytest's traceback, run with PYTHONPATH at the copy: workers start from it too). A test that
fails anywhere else (the mutant died another way, a fixture broke) counts as incidental, not caught: the
designed assertion might be dead. `--baseline` (implied by `--out`) first runs every named test on an
unmutated copy and stops unless all pass.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
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


def _apply(dest: Path, m: Mutation) -> None:
    for file, old, new in m.edits:
        path = dest / file
        text = path.read_text()
        n = text.count(old)
        if n != 1:
            raise SystemExit(
                f"mutation {m.name}: {old!r} occurs {n} times in {file} (expected once): "
                f"the code moved, update tests/mutate.py"
            )
        path.write_text(text.replace(old, new))
        compile(path.read_text(), str(path), "exec")  # a mutant that does not parse would be "caught" by anything


def _pytest(dest: Path, tests: tuple[str, ...], timeout: float, *extra: str) -> tuple[Path | None, float]:
    """Run the tests in the copy at dest; (junit report or None on timeout, seconds)."""
    xml = dest / "junit.xml"
    xml.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(dest), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", f"--junitxml={xml}"]
    t0 = time.time()
    try:
        subprocess.run(
            [*cmd, *extra, *tests],
            cwd=dest,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return None, time.time() - t0
    return (xml if xml.is_file() else None), time.time() - t0


def _where(dest: Path, report: str) -> tuple[str, str]:
    """The test-suite statement a failure was raised at: ("tests/file.py:LINE", its source on one line), from the
    innermost frame under tests/ of pytest's short traceback; ("", "") when no frame is in the suite."""
    frames = re.findall(r"^(tests/[\w/]+\.py):(\d+): ", report, re.M)
    if not frames:
        return "", ""
    file, line = frames[-1][0], int(frames[-1][1])
    src = (dest / file).read_text()
    inner = None
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if not isinstance(node, (ast.FunctionDef, ast.With, ast.For, ast.If, ast.Try, ast.While)):
                if inner is None or node.lineno >= inner.lineno:
                    inner = node
    text = ast.get_source_segment(src, inner) if inner is not None else src.splitlines()[line - 1]
    return f"{file}:{line}", " ".join((text or "").split())


def run(m: Mutation, timeout: float) -> list[tuple[str, str, float, str, str]]:
    """(test, outcome, seconds, where, why) for each test of the mutation. outcome: caught (failed at the
    statement the mutation names in `catch`) | incidental (failed elsewhere: the run died another way, a setup
    error) | MISSED (passed) | timeout | error; where: file:line and statement it failed at; why: the first
    line of the failure."""
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
            at, stmt = _where(dest, bad.text or "")
            designed = bad.tag == "failure" and bool(m.catch) and m.catch in stmt
            stmt = stmt if len(stmt) <= 160 else stmt[:157] + "..."
            why = " ".join((bad.get("message") or "").split())[:120]
            out.append((name, "caught" if designed else "incidental", float(case.get("time", 0)), f"{at} {stmt}", why))
        return out or [(t, "error", secs, "", "no test ran") for t in m.tests]


def baseline(chosen: list[Mutation], timeout: float, workers: int) -> tuple[int, int, float]:
    """Run every test the chosen mutations name on an unmutated copy: (passed, failed, seconds). A mutation
    table means something only on a green baseline."""
    tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
    with tempfile.TemporaryDirectory(prefix="mutant-baseline-") as d:
        dest = Path(d)
        _copy(dest)
        xml, secs = _pytest(dest, tests, timeout, "-n", str(workers), "--dist", "loadfile")
        if xml is None:
            return 0, len(tests), secs
        cases = list(ET.parse(xml).getroot().iter("testcase"))
        failed = sum(c.find("failure") is not None or c.find("error") is not None for c in cases)
        return len(cases) - failed, failed + max(0, len(tests) - len(cases)), secs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="mutations to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
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
                rows.append(
                    f"| `{m.name}` | {m.what} | `{test}` | {outcome} | `{m.catch}` | {cells[0]} "
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
            "A mutation is caught when every test it names fails at the statement named in `catch`"
            " (tests/mutations.py); a failure elsewhere is incidental.\n\n"
            + "\n".join(head)
            + f"{caught}/{len(chosen)} caught by their designed assertion.\n\n"
            + "\n".join(table)
            + "\n"
        )
    if bad:
        print(f"not caught by the designed assertion: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
