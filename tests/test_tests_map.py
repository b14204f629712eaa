"""tests/README.md is a map from each promise of the docs to the tests that fail when it breaks and the planted
bugs (tests/mutations.py) that prove they do. Read without running anything (the test files are parsed, not
collected), so a renamed test, a dropped mutation or a new mutation left off the map shows here."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from mutations import MUTATIONS

TESTS = Path(__file__).resolve().parent
TEST_ID = re.compile(r"tests/(test_\w+\.py)::(\w+)")
NAME = re.compile(r"`(\w+)`")


def _items(text: str) -> list[str]:
    """The map's entries: a line starting `- ` and the indented lines after it."""
    items: list[str] = []
    for line in text.splitlines():
        if line.startswith("- "):
            items.append(line)
        elif items and line.startswith("  ") and line.strip():
            items[-1] += "\n" + line
        elif items and not line.startswith("  "):
            items.append("")  # anything else ends the entry
    return [i for i in items if i]


@functools.cache  # parsed once per file: the map is checked against several texts
def _test_functions(file: str) -> set[str]:
    path = TESTS / file
    if not path.is_file():
        return set()
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def problems(text: str) -> list[str]:
    """What is wrong with a map's text: named tests or mutations that do not exist, a mutation beside tests
    none of which is one of its own, a mutation the map leaves out."""
    mutations = {m.name: {t.split("[")[0] for t in m.tests} for m in MUTATIONS}
    found, cited = [], set()
    for item in _items(text):
        tests = {f"tests/{f}::{name}" for f, name in TEST_ID.findall(item)}
        for test in sorted(tests):
            file, name = test[len("tests/") :].split("::")
            if name not in _test_functions(file):
                found.append(f"{test}: no such test function")
        if "Mutations:" not in item:
            continue
        for name in NAME.findall(item.split("Mutations:", 1)[1]):
            cited.add(name)
            if name not in mutations:
                found.append(f"mutation {name}: not in tests/mutations.py")
            elif not mutations[name] & tests:
                found.append(f"mutation {name}: none of its tests ({sorted(mutations[name])}) is beside it")
    for name in sorted(set(mutations) - cited):
        found.append(f"mutation {name}: not on the map (add it beside the promise it breaks)")
    return found


def test_every_test_and_mutation_the_map_names_exists():
    text = (TESTS / "README.md").read_text()
    assert len(TEST_ID.findall(text)) > 100  # the map, not an empty page
    found = problems(text)
    assert found == [], "\n".join(found)


def test_a_bogus_name_is_found():
    text = (TESTS / "README.md").read_text()
    assert problems(text) == []
    bogus = text.replace(
        "`tests/test_resume.py::test_stop_and_resume_is_bit_identical`",
        "`tests/test_resume.py::test_stop_and_resume_is_bit_identical_renamed`",
    )
    found = problems(bogus)
    assert "tests/test_resume.py::test_stop_and_resume_is_bit_identical_renamed: no such test function" in found
    # Its mutations are now beside no test of theirs (prng_key_not_restored's only test was the renamed one).
    assert "mutation prng_key_not_restored: none of its tests" in "\n".join(found)
    assert problems(text + "\n- **A promise.** `tests/test_nowhere.py::test_x`\n") == [
        "tests/test_nowhere.py::test_x: no such test function"
    ]
    assert problems(text.replace("`synchronous_save`", "`asynchronous_save`")) == [
        "mutation asynchronous_save: not in tests/mutations.py",
        "mutation synchronous_save: not on the map (add it beside the promise it breaks)",
    ]
