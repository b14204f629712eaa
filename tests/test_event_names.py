"""The suite names events by their constants (trainer/store/event_names.py as E), never by a string of its own,
so a renamed or misspelt event fails here, not silently in a comparison that is never true. Read from the test
files' source (parsed, not collected), so a slow test's names are checked without running it."""

from __future__ import annotations

import ast
from pathlib import Path

from trainer.store import event_names as E

TESTS = Path(__file__).resolve().parent
# The suite's helpers that take an event's name, and where: _of(run, NAME), _first(run, NAME), ev(NAME, at).
EVENT_HELPERS = {"_of": 1, "_first": 1, "ev": 0}


def _reads_event(node: ast.expr) -> bool:
    """`x["event"]` or `x.get("event")`: an event record's name."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "event"
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "event"
    )


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _strings(node: ast.expr) -> list[ast.Constant]:
    """A string constant, or those a tuple, list or set display holds."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [c for c in items if _is_str(c)]


def _named_in(node: ast.AST) -> list[ast.Constant]:
    """The string constants this node uses as an event's name (the three places literal_event_names names)."""
    if isinstance(node, ast.Compare):
        sides, found = [node.left, *node.comparators], []
        for i, side in enumerate(sides):
            others = sides[:i] + sides[i + 1 :]
            if any(_reads_event(o) for o in others):
                found += _strings(side)
            for o in others:  # (e["event"], e["step"]) == ("restore", 10): element by element
                if isinstance(side, ast.Tuple) and isinstance(o, ast.Tuple) and len(side.elts) == len(o.elts):
                    found += [c for c, r in zip(side.elts, o.elts) if _is_str(c) and _reads_event(r)]
        return found
    if isinstance(node, ast.Dict):
        return [v for k, v in zip(node.keys, node.values) if _is_str(k) and k.value == "event" and _is_str(v)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in EVENT_HELPERS:
        at = EVENT_HELPERS[node.func.id]
        return _strings(node.args[at]) if len(node.args) > at else []
    return []


def literal_event_names(source: str) -> list[tuple[int, str]]:
    """(line, text) of each string the source writes where it means an event's name: an operand of a comparison
    with an event record's name (`e["event"] == "step"`, `e.get("event") in ("a", "b")`), the value of a
    made-up record's "event" key (`{"event": "step", ...}`), or the name argument of an EVENT_HELPERS call.
    Any string there is flagged, an event's or a misspelling; a constant (`E.STEP`) never is."""
    found = {(c.lineno, c.col_offset, c.value) for node in ast.walk(ast.parse(source)) for c in _named_in(node)}
    return [(line, text) for line, _, text in sorted(found)]


def test_the_tests_name_events_by_their_constants():
    found = [
        f"{path.name}:{line}: {text!r}"
        for path in sorted(TESTS.glob("*.py"))
        for line, text in literal_event_names(path.read_text())
    ]
    assert found == [], "name these events by trainer.store.event_names (E.NAME):\n" + "\n".join(found)


def test_every_event_constant_the_tests_name_exists():
    """E.NAME in a test that imports event_names as E: a misspelt one would raise only when that test runs."""
    imports_e = "from trainer.store import event_names as E\n"
    found = [
        f"{path.name}:{node.lineno}: E.{node.attr}"
        for path in sorted(TESTS.glob("*.py"))
        if imports_e in (text := path.read_text())
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "E"
        if not hasattr(E, node.attr)
    ]
    assert found == [], "no such event in trainer/store/event_names.py:\n" + "\n".join(found)


def test_a_literal_event_name_is_found_and_a_constant_is_not():
    flagged = """
[e for e in evs if e["event"] == "hang_detected"]
[e for e in evs if "restore" == e["event"] or e.get("event") in ("step", "eval")]
assert (lost["event"], lost["node"]) == ("supervisor_lost", "n1")
records = [{"event": "worker_start", "time": 1.0}]
restores, first, made = _of(run, "restore"), _first(run, "rewind"), ev("stepp", 3)
"""
    assert [t for _, t in literal_event_names(flagged)] == [
        "hang_detected",
        "restore",
        "step",
        "eval",
        "supervisor_lost",
        "worker_start",
        "restore",
        "rewind",
        "stepp",
    ]
    named = """
[e for e in evs if e["event"] == E.HANG_DETECTED and e["phase"] == "step" and e.get("kind") == "step_overdue"]
assert (lost["event"], lost["node"]) == (E.SUPERVISOR_LOST, "n1")
records = [{"event": E.WORKER_START, "phase": "restore"}], _of(run, E.RESTORE), ev(E.STEP, 3), write("step")
"""
    assert literal_event_names(named) == []
