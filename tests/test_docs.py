"""Every command shown in README.md and docs/*.md is exercised, and every relative link there resolves.

What is a command (the rule):
- each line of a fenced ```bash block (a trailing backslash continues it, a `# ...` comment is dropped, and
  `a && b` is two commands); other fences (yaml, text, the layout tree) hold no commands;
- each inline code span of the prose that starts with `python `, `python3 `, `bash `, `sbatch ` or
  `tensorboard ` (a span may run over a line break).
Synopsis notation is read as: UPPERCASE words are placeholders (PLACEHOLDERS), `[...]` marks optional parts,
which are kept, `...` is dropped, and `A|B` takes A.

How each is exercised (a command none of these takes fails test_every_command_is_exercised, saying where it
is and what to do):
- `python -m trainer ...` (and the trainer arguments of `sbatch ... launch/slurm.sbatch ...`): parsed by the
  CLI's own argparse parsers (trainer.__main__.main, stopped right after its parse_args), so a renamed command
  or flag fails; with --config the config is built with its --set overrides, so a renamed key fails. Then:
  - RUN, the cheap ones (read-only commands on a run, survival): run in-process for real against a copy of
    the session's finished reference run (conftest.reference_run, built once and shared), and must exit 0;
  - MAPPED, the rest (training, drills, SLURM jobs, prepare, inspect, audit): the test(s) that run that command
    form. Each node id must exist, and its module's source (with the shared helpers in tests/) must name the
    subcommand and every flag and --set key the doc shows (for sbatch, its own flags and the batch script too).
    PARSED_ONLY lists the few flags shown that no test runs: the gaps, in plain sight.
- `python -m benchmarks.X`, `python benchmarks/X.py`, `python tests/X.py`: the script exists and names every
  flag the doc shows (the benchmarks' own smoke tests are in tests/test_benchmarks_smoke.py).
- `bash X.sh`: the script exists and `bash -n` parses it.
- the setup lines (venv, activate, pip install, the suite's command): SETUP, what .ci/run (CI, on a fresh clone)
  runs for each, verbatim; the inner loop's `-m "not slow"` needs the marker pyproject.toml declares.
- `tensorboard --logdir RUN_DIR/tb`: tensorboard is installed and the finished run has event files there.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

from trainer import __main__ as cli
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SPAN_STARTS = ("python ", "python3 ", "bash ", "sbatch ", "tensorboard ")

# Placeholder -> what a parse gets (a run for real substitutes paths of its own, see _for_real).
PLACEHOLDERS = {
    "FILE": "configs/tiny.yaml",
    "RUN_DIR": "runs/tiny",
    "OTHER_RUN": "runs/tiny",
    "DIR": "out",
    "PATH": "corpus.txt",
    "N": "1",
    "TEXT": "def",
    "SPEC": "bytes",
    "KINDS": "crash",
    "COMMAND": "status",
    "KEY=VALUE": "train.steps=5",
}

# Subcommands cheap enough to run for real, in-process, on a finished micro run.
RUN = ("status", "report", "checkpoints", "survival", "export", "sample")

# Command form (a regex searched in the command as written) -> the test(s) that run it. The first match wins.
MAPPED = {
    r"^python -m trainer --config \S+ --worker": ["tests/test_resume.py::test_stop_and_resume_is_bit_identical"],
    r"train\.init_from": ["tests/test_export.py::test_init_from_a_finished_run_live_export_and_bitwise_resume"],
    r"launch\.processes=2 --set mesh\.cpu_devices": [
        "tests/test_multihost.py::test_kill_and_hang_tear_the_group_down_and_the_run_ends_identical"
    ],
    r"^sbatch .*slurm\.sbatch drill": [
        "tests/test_drill.py::test_a_drill_inside_a_slurm_allocation_loses_a_node_and_passes"
    ],
    r"^sbatch ": ["tests/test_slurm_job.py::test_sbatch_job_survives_a_killed_task_and_a_preemption"],
    r"data\.tokenizer=bpe": [
        "tests/test_eval.py::test_eval_never_changes_training_and_its_loss_falls",
        "tests/test_export.py::test_a_prepared_tokenizer_is_exported_and_sample_uses_it",
    ],
    r"^python -m trainer --config ": [
        "tests/test_first_hour.py::test_a_finished_run_rerun_says_so_and_changes_no_byte"
    ],
    r"^python -m trainer drill ": [
        "tests/test_drill.py::test_a_drill_of_the_micro_config_heals_every_fault_and_ends_as_the_undisturbed_run",
        "tests/test_drill.py::test_a_drill_too_short_to_show_anything_is_refused_grown_or_failed",
    ],
    r"^python -m trainer prepare --from-tokens": [
        "tests/test_prepare.py::test_from_tokens_imports_nanogpt_train_and_val_bins"
    ],
    r"^python -m trainer prepare ": [
        "tests/test_prepare.py::test_bpe_meta_shards_and_whole_documents_held_out",
        "tests/test_prepare.py::test_output_does_not_depend_on_the_worker_count",
    ],
    r"^python -m trainer inspect ": [
        "tests/test_hlo.py::test_inspect_lists_the_vocabulary_matmuls_and_says_whether_all_are_bf16"
    ],
    r"^python -m trainer audit ": ["tests/test_multihost.py::test_audit_passes_restarts_and_elastic_resume"],
    r"^python -m trainer (COMMAND )?--help": [
        "tests/test_first_hour.py::test_the_cli_lists_commands_suggests_and_never_trains_by_accident"
    ],
}

# Lines a fresh machine runs before anything else -> what .ci/run (CI, on a fresh clone) runs verbatim for it.
SETUP = {
    "python3 -m venv .venv": "python3 -m venv .venv",
    ". .venv/bin/activate": ". .venv/bin/activate",
    "pip install -e .": "pip install -e '.[test]'",  # the same package, with the test extras
    "pip install -e '.[test]'": "pip install -e '.[test]'",
    "python -m pytest -q -n 4 --dist loadfile tests": "python -m pytest -q -n 4 --dist loadfile tests",
}
# (subcommand, flag) shown in the docs that no test runs: the real parser takes them (test_trainer_commands_parse_
# and_their_configs_build), no run does. Keep this short; each entry is a gap, not an exemption.
PARSED_ONLY: set[tuple[str, str]] = set()  # none left: the drill's projection flags run in test_drill
# The inner loop is the suite's own marker selection: pyproject.toml declares the marker it names.
INNER_LOOP = 'python -m pytest -q tests -m "not slow" -x'
HELPERS = ("conftest.py", "corpora.py", "multihost.py", "slurm_cluster.py")


class Command:
    def __init__(self, page: Path, line: int, text: str):
        self.page, self.line, self.text = page, line, " ".join(text.split())

    def __repr__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}: {self.text}"


def commands(page: Path) -> list[Command]:
    """The commands of one page, by the rule in this module's docstring."""
    out, prose, fence, pending = [], [], None, ""
    for no, line in enumerate(page.read_text().splitlines(), 1):
        if re.match(r"^\s*```", line):
            fence = None if fence is not None else line.strip().strip("`")
            prose.append("")
            continue
        if fence is None:
            prose.append(line)
            continue
        prose.append("")
        if fence != "bash" or line.lstrip().startswith("#"):
            continue
        body = re.sub(r"\s+#.*$", "", line).strip()
        if body.endswith("\\"):
            pending += body[:-1] + " "
            continue
        for part in (pending + body).split(" && "):
            if part.strip():
                out.append(Command(page, no, part))
        pending = ""
    text = "\n".join(prose)
    for m in re.finditer(r"`([^`]+)`", text):
        if m.group(1).startswith(SPAN_STARTS):
            out.append(Command(page, text.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


ALL = [c for page in PAGES for c in commands(page)]


def argv_of(command: str) -> list[str]:
    """The words of a command with its synopsis notation read (module docstring) and placeholders filled."""
    words = []
    for w in shlex.split(command.replace("[", " ").replace("]", " ")):
        if w == "...":
            continue
        w = w.split("|")[0] if w.startswith("-") or w.isupper() else w
        w = PLACEHOLDERS.get(w) or re.sub(r"\b[A-Z][A-Z_]+\b", lambda m: PLACEHOLDERS.get(m.group(), m.group()), w)
        words.append(w)
    return words


def trainer_args(words: list[str]) -> list[str] | None:
    """The arguments trainer.__main__ gets, or None for a command that is not the trainer's."""
    if words[:3] == ["python", "-m", "trainer"]:
        return words[3:]
    if words[0] == "sbatch":
        script = next(i for i, w in enumerate(words) if w.endswith("slurm.sbatch"))
        return words[script + 1 :]
    return None


class _Parsed(BaseException):
    """Raised by the patched parse_args once the real parser accepted the arguments."""


def parse_only(args: list[str]) -> argparse.Namespace:
    """The CLI's real parsers on args, stopped before anything runs."""
    real = argparse.ArgumentParser.parse_args

    def stop(self, *a, **kw):
        raise _Parsed(real(self, *a, **kw))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", stop):
        try:
            rc = cli.main(args)
        except _Parsed as parsed:
            return parsed.args[0]
        except SystemExit as e:
            if e.code == 0 and "--help" in args:  # --help prints and exits 0 from inside the parse
                return argparse.Namespace()
            raise AssertionError(f"the parser refused it (exit {e.code})") from None
    raise AssertionError(f"the CLI exited {rc} in or before its parse: a command or flag it does not know")


def _sets(args: list[str]) -> list[str]:
    return [args[i + 1] for i, w in enumerate(args[:-1]) if w == "--set"]


def _flags(args: list[str]) -> list[str]:
    return [w.split("=")[0] for w in args if w.startswith("--")]


@pytest.mark.parametrize("cmd", [c for c in ALL if trainer_args(argv_of(c.text)) is not None], ids=repr)
def test_trainer_commands_parse_and_their_configs_build(cmd):
    args = trainer_args(argv_of(cmd.text))
    ns = parse_only(args)
    if getattr(ns, "config", None):
        load_config(str(ROOT / ns.config), _sets(args))


def _mapped(cmd: Command) -> list[str] | None:
    return next((ids for pattern, ids in MAPPED.items() if re.search(pattern, cmd.text)), None)


def _source(test_file: Path) -> str:
    return "\n".join([test_file.read_text(), *((ROOT / "tests" / h).read_text() for h in HELPERS)])


def _check_mapped(cmd: Command, node_ids: list[str]) -> list[str]:
    problems, sources = [], ""
    for node in node_ids:
        file, name = node.split("::")
        path = ROOT / file
        tree = ast.parse(path.read_text()) if path.is_file() else ast.Module(body=[], type_ignores=[])
        if not any(isinstance(f, ast.FunctionDef) and f.name == name for f in tree.body):
            problems.append(f"{cmd!r}: mapped to {node}, which does not exist")
        sources += _source(path) if path.is_file() else ""
    words = argv_of(cmd.text)
    args = trainer_args(words) or []
    sub = [args[0]] if args and not args[0].startswith("-") else []
    keys = [s.split("=")[0] for s in _sets(args)]
    job = [*_flags(words[1 : len(words) - len(args)]), "slurm.sbatch"] if words[0] == "sbatch" else []
    for word in [*job, *sub, *_flags(args), *keys]:
        if (sub[:1] and (sub[0], word) in PARSED_ONLY) or word == "--help":
            continue
        if word not in sources:
            problems.append(f"{cmd!r}: none of {node_ids} names {word}")
    return problems


def _script_problems(cmd: Command, words: list[str]) -> list[str]:
    if words[:2] == ["python", "-m"]:
        path = ROOT / (words[2].replace(".", "/") + ".py")
        flags = _flags(words[3:])
    else:
        path, flags = ROOT / words[1], _flags(words[2:])
    if not path.is_file():
        return [f"{cmd!r}: {path.relative_to(ROOT)} does not exist"]
    source = path.read_text() + (ROOT / "benchmarks" / "harness.py").read_text()
    return [f"{cmd!r}: {path.relative_to(ROOT)} has no flag {f}" for f in flags if f'"{f}"' not in source]


def test_every_command_is_exercised():
    """Each command is taken by one of the ways in the module docstring; an unmatched one is a failure."""
    ci_run = (ROOT / ".ci" / "run").read_text()
    markers = (ROOT / "pyproject.toml").read_text()
    problems = []
    for cmd in ALL:
        words = argv_of(cmd.text)
        args = trainer_args(words)
        if cmd.text in SETUP:
            problems += [] if SETUP[cmd.text] in ci_run else [f"{cmd!r}: .ci/run does not run {SETUP[cmd.text]}"]
        elif cmd.text == INNER_LOOP:
            problems += [] if '"slow' in markers else [f"{cmd!r}: pyproject.toml declares no slow marker"]
        elif words[0] == "bash":
            script = ROOT / words[1]
            ok = script.is_file() and subprocess.run(["bash", "-n", str(script)]).returncode == 0
            problems += [] if ok else [f"{cmd!r}: {words[1]} is missing or not valid bash"]
        elif words[0] == "tensorboard":
            pass  # test_tensorboard_command
        elif args is not None and args and args[0] in RUN and "--help" not in args:
            pass  # test_cheap_commands_run
        elif args is not None and (ids := _mapped(cmd)):
            problems += _check_mapped(cmd, ids)
        elif words[0] == "python" and (
            words[1].startswith(("benchmarks/", "tests/")) or words[2:3] and words[2].startswith("benchmarks.")
        ):
            problems += _script_problems(cmd, words)
        else:
            problems.append(
                f"{cmd!r}: no test exercises this command. Add its form to RUN (cheap: it runs for real) or to "
                "MAPPED (a regex -> the test node id that runs it) in tests/test_docs.py"
            )
    assert not problems, "\n".join(problems)


def _for_real(args: list[str], run: Path, tmp: Path) -> list[str]:
    """args with the run dir pointed at the finished run and every output at a fresh path under tmp."""
    out = []
    for i, w in enumerate(args):
        prev = args[i - 1] if i else ""
        if prev in ("--out", "--html", "--plot"):
            w = str(tmp / f"out{i}-{Path(w).name}")
        elif prev == "--step":
            w = str(max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()))
        elif w.startswith("runs/"):
            w = str(run)
        out.append(w)
    return out


@pytest.mark.slow  # the session's reference run is a training run (shared: built once for the modules that use it)
def test_cheap_commands_run(reference_run, tmp_path, capsys):
    """The RUN commands, each distinct form once (placeholders filled), on a copy of the finished micro run."""
    run = tmp_path / "run"
    shutil.copytree(reference_run(), run)  # report writes into the run dir: keep the shared one untouched
    seen, failed, timings = set(), [], []
    for cmd in ALL:
        args = trainer_args(argv_of(cmd.text))
        if not args or args[0] not in RUN or "--help" in args:
            continue
        real = _for_real(args, run, tmp_path)
        form = (real[0], tuple(_flags(real)))
        if form in seen:
            continue
        seen.add(form)
        t0 = time.perf_counter()
        try:
            rc = cli.main(real)
        except SystemExit as e:
            rc = e.code
        err = capsys.readouterr().err
        timings.append(f"{time.perf_counter() - t0:6.1f} s  {' '.join(args)}")
        if rc != 0:
            failed.append(f"{cmd!r}: exit {rc}\n{err[-2000:]}")
    with capsys.disabled():
        print("\n" + "\n".join(timings), file=sys.stderr)  # seen with -s: what each command costs
    assert not failed, "\n".join(failed)
    assert {f[0] for f in seen} == set(RUN), seen  # every cheap subcommand is shown somewhere


@pytest.mark.slow
def test_tensorboard_command(reference_run):
    tb = [c for c in ALL if c.text.startswith("tensorboard ")]
    assert tb, "no tensorboard command shown any more: drop this test"
    assert shutil.which("tensorboard") or (Path(sys.executable).parent / "tensorboard").exists()
    for cmd in tb:
        words = argv_of(cmd.text)
        assert words[1] == "--logdir" and words[2] == "runs/tiny/tb", cmd
        assert list((reference_run() / "tb").glob("events.out.tfevents.*")), "a finished run has no tb/ events"


def _anchors(page: Path) -> set[str]:
    heads = re.findall(r"^#+\s+(.*)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in heads}


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for m in re.finditer(r"\]\(([^)\s]+)\)", page.read_text()):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_front_door():
    assert (ROOT / "README.md").stat().st_size <= 12 * 1024
