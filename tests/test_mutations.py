"""The mutation harness (tests/mutate.py) checked without running a mutant: every planted bug still names live
tests, anchors and assertions; "caught" means the designed assertion failed; a timed-out mutant leaves nothing
running."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import mutate
from mutations import MUTATIONS, Mutation


def test_every_mutation_names_tests_that_exist_anchors_that_occur_once_and_catches_in_its_tests():
    """Pure parsing (pytest is asked only about ids the source cannot settle): a renamed test, a moved anchor
    or a reworded assertion shows here, not as a failed baseline twenty minutes into a table."""
    found = mutate.problems(MUTATIONS)
    assert found == [], "\n".join(found)


def test_the_static_check_finds_a_renamed_test_a_moved_anchor_and_a_missing_catch(monkeypatch):
    good, asked = MUTATIONS[0], []  # an id the source does not list is put to pytest (seconds: an import)
    monkeypatch.setattr(mutate, "_collected", lambda root, file: asked.append(file) or {good.tests[0]})
    file, old, new = good.edits[0]
    bad = [
        Mutation("renamed", "", good.edits, (good.tests[0].split("[")[0] + "_renamed",), good.catch),
        Mutation("bad_param", "", good.edits, (good.tests[0].split("[")[0] + "[no_such_case]",), good.catch),
        Mutation("moved", "", ((file, old + "#moved", new),), good.tests, good.catch),
        Mutation("twice", "", (*good.edits, (file, old, new)), good.tests, good.catch),
        Mutation("unparsable", "", ((file, old, new + "("),), good.tests, good.catch),
        Mutation("no_catch", "", good.edits, good.tests, "an assertion nobody wrote"),
    ]
    found = mutate.problems(bad)
    for m in bad:
        assert sum(p.startswith(f"{m.name}: ") for p in found) == 1, (m.name, found)
    assert asked == [good.tests[0].split("::")[0]]


def test_an_anchor_follows_its_code_to_another_module():
    """A module moved or renamed: the edit names the old path, the harness finds the one module under trainer/
    that holds the text; text held by two modules is not guessed."""
    good = MUTATIONS[0]
    file, old, new = good.edits[0]
    moved = Mutation("moved_file", "", (("trainer/no_such_dir/old_name.py", old, new),), good.tests, good.catch)
    assert mutate.edited_files(moved, mutate.ROOT) == [file]
    assert mutate.problems([moved]) == []
    common = "from __future__ import annotations"
    vague = Mutation("vague", "", (("trainer/no_such_dir/old_name.py", common, common + "  "),), good.tests, good.catch)
    assert mutate.edited_files(vague, mutate.ROOT) == ["trainer/no_such_dir/old_name.py"]
    assert any(p.startswith("vague: ") for p in mutate.problems([vague]))


_CASES = {  # test body -> does it fail at its designed assertion (a statement containing "designed")?
    "x = 3\n    assert x == 2, 'designed'": True,
    "assert lookup(3) == 2, 'designed'": False,  # a KeyError at the designed line
    "assert check() is None, 'designed'": False,  # an assert inside the code it calls
    "assert 1 == 2, 'other'\n    assert 3 == 4, 'designed'": False,  # another statement
    "with pytest.raises(ValueError):  # designed\n        pass": True,
    "with pytest.raises(ValueError):  # designed\n        lookup(1)": False,
}


def test_caught_means_an_assertion_error_raised_by_the_designed_statement_itself(tmp_path):
    """Only the statement's own assert (or its pytest.raises) counts; another exception at that line, an
    assert deeper in the code it calls, or a failure at another statement is incidental. Run the way
    mutate.py runs a mutant's tests (a scratch tree: tests/, a package the tests call)."""
    import xml.etree.ElementTree as ET

    (tmp_path / "tests").mkdir()
    (tmp_path / "pkg").mkdir()
    code = "def lookup(k):\n    return {}[k]\n\n\ndef check():\n    assert False\n"
    (tmp_path / "pkg" / "__init__.py").write_text(code)
    tests = "".join(f"\n\ndef test_{i}():\n    {body}\n" for i, body in enumerate(_CASES))
    (tmp_path / "tests" / "test_t.py").write_text(f"import pytest\nfrom pkg import check, lookup\n{tests}")
    xml, _ = mutate._pytest(tmp_path, ("tests/test_t.py",), 60)
    assert xml is not None
    verdicts = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        caught, where = mutate._judge(tmp_path, bad.tag, bad.get("message") or "", bad.text or "", "designed")
        verdicts[list(_CASES)[int(case.get("name").split("_")[1])]] = caught
    assert verdicts == _CASES


_HANGS = """
import os, subprocess, sys, time

def test_hangs():
    here = os.path.dirname(os.path.abspath(__file__))
    # as tests/slurm_cluster.py starts its daemons: a session of their own, outside pytest's process group
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    # a process that kept neither the environment nor the group, only its working directory in the copy
    stray = subprocess.Popen(["sleep", "600"], cwd=here, env={"PATH": os.environ["PATH"]}, start_new_session=True)
    open(os.path.join(here, "pids"), "w").write(f"{daemon.pid} {stray.pid}")
    time.sleep(600)
"""


def test_a_mutant_that_times_out_leaves_no_process_of_its_copy_running(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_hang.py").write_text(_HANGS)
    pids = tmp_path / "tests" / "pids"
    t0 = time.monotonic()
    xml, secs = mutate._pytest(tmp_path, ("tests/test_hang.py",), 8)
    assert xml is None and secs >= 8
    assert pids.is_file(), "the hanging test never started its processes: raise the timeout"
    daemon, stray = map(int, pids.read_text().split())
    for pid in (daemon, stray):
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), pid
    assert mutate._ours(tmp_path, set()) == []
    assert time.monotonic() - t0 < 30
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert [p for p in left if int(p) != os.getpid()] == [], left


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
