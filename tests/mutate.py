"""Mutation harness (not collected by pytest): plant one plausible bug at a time in a scratch copy of the
repository, run the tests that promise to catch it there, and print a table (mutation, test, caught?).

    python tests/mutate.py                       # every mutation (~40 min on 2 cores)
    python tests/mutate.py prng_key_not_restored data_cursor_off_by_one   # some of them
    python tests/mutate.py --list                # names only
    python tests/mutate.py --out benchmarks/results/mutations.md          # also write the table there

Each mutation is a list of edits (file, old text, new text); the old text must occur exactly once, so the
harness fails loudly when the code it mutates has moved. A test "caught" the mutation when it failed or
errored against the mutated copy (run with PYTHONPATH at the copy: workers start from it too). Every
listed test passes on the unmutated code (that is the suite itself).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPY = ("trainer", "tests", "configs", "launch", "benchmarks", "pyproject.toml", "README.md")


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the bug, in words
    edits: tuple[tuple[str, str, str], ...]  # (file, old, new)
    tests: tuple[str, ...]  # pytest node ids that should catch it


M = Mutation
MUTATIONS = [
    M(
        "prng_key_not_restored",
        "the checkpoint saves the dropout PRNG key as zeros",
        (
            (
                "trainer/core/loop.py",
                "blocking = w.ckpt.save(step, st, {",
                "blocking = w.ckpt.save(step, dict(st, rng=st['rng'] * 0), {",
            ),
        ),
        ("tests/test_resume.py::test_stop_and_resume_is_bit_identical[data8_dropout]",),
    ),
    M(
        "data_cursor_off_by_one",
        "a resumed data iterator starts one batch late",
        (("trainer/core/loop.py", 'it.set_state({"next_index": start})', 'it.set_state({"next_index": start + 1})'),),
        ("tests/test_resume.py::test_stop_and_resume_is_bit_identical[fsdp8_microbatches2]",),
    ),
    M(
        "fallback_to_oldest",
        "after rejecting the newest checkpoint the restore takes the oldest, not the previous",
        (
            (
                "trainer/core/tiers.py",
                "            self._move_aside(ck, step)\n",
                "            self._move_aside(ck, step)\n            self.fell_back = True\n",
            ),
            (
                "trainer/core/tiers.py",
                "return max(cands, key=lambda c: (c[0], c[1] == LOCAL), default=None)",
                "return (min if getattr(self, 'fell_back', False) else max)"
                "(cands, key=lambda c: (c[0], c[1] == LOCAL), default=None)",
            ),
        ),
        tuple(
            f"tests/test_integrity.py::test_a_bad_newest_checkpoint_is_rejected_and_the_previous_one_used[{how}]"
            for how in ("bytes_flipped", "deleted", "meta_torn", "truncated", "unsealed")
        ),
    ),
    M(
        "torn_meta_crashes_the_resume_check",
        "a torn metadata item in the newest checkpoint is read outside the "
        "fallback path (the resume check raises instead of asking an older checkpoint)",
        (
            (
                "trainer/core/tiers.py",
                "        except Exception:  # torn or corrupt: an older one answers the same question",
                "        except FileNotFoundError:  # torn or corrupt: an older one answers the same question",
            ),
        ),
        ("tests/test_integrity.py::test_a_bad_newest_checkpoint_is_rejected_and_the_previous_one_used[meta_torn]",),
    ),
    M(
        "synchronous_save",
        "Orbax saves synchronously (the loop blocks until the checkpoint is written)",
        (
            (
                "trainer/core/checkpoint.py",
                "enable_async_checkpointing=cfg.async_save,",
                "enable_async_checkpointing=False,",
            ),
        ),
        ("tests/test_checkpoint.py::test_saving_is_asynchronous_steps_go_on_while_slow_storage_commits",),
    ),
    M(
        "restore_timeout_is_step_timeout",
        "a hung restore is judged by the step timeout",
        (("trainer/observe/heartbeat.py", '"restore": sc.restore_timeout_s', '"restore": sc.step_timeout_s'),),
        ("tests/test_supervisor.py::test_hangs_in_every_phase_are_detected_by_their_own_timeout_dumped_and_recovered",),
    ),
    M(
        "startup_timeout_is_step_timeout",
        "a worker hung while starting is judged by the step timeout",
        (("trainer/observe/heartbeat.py", '"startup": sc.startup_timeout_s,', '"startup": sc.step_timeout_s,'),),
        ("tests/test_supervisor.py::test_hangs_in_every_phase_are_detected_by_their_own_timeout_dumped_and_recovered",),
    ),
    M(
        "checkpoint_timeout_is_step_timeout",
        "a hung checkpoint write is judged by the step timeout",
        (
            (
                "trainer/observe/heartbeat.py",
                '"checkpoint": sc.checkpoint_timeout_s,',
                '"checkpoint": sc.step_timeout_s,',
            ),
        ),
        ("tests/test_supervisor.py::test_hangs_in_every_phase_are_detected_by_their_own_timeout_dumped_and_recovered",),
    ),
    M(
        "compile_timeout_is_step_timeout",
        "a hung compile is judged by the step timeout",
        (("trainer/observe/heartbeat.py", '"compile": sc.startup_timeout_s', '"compile": sc.step_timeout_s'),),
        ("tests/test_supervisor.py::test_hangs_in_every_phase_are_detected_by_their_own_timeout_dumped_and_recovered",),
    ),
    M(
        "skips_persisted_before_rewind",
        "the runbook writes the new skip list before it moves the spiked "
        "checkpoints aside (a kill in between pairs the new skips with a checkpoint that trained on the spike)",
        (
            (
                "trainer/supervise/runbook.py",
                '    target, moved = rewind(run_dir, spike["began"], n)\n',
                '    ckpts = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())\n'
                '    target = max((s for s in ckpts if s < spike["began"]), default=0)\n',
            ),
            (
                "trainer/supervise/runbook.py",
                "    state.save(run_dir)\n",
                '    state.save(run_dir)\n    target, moved = rewind(run_dir, spike["began"], n)\n',
            ),
        ),
        ("tests/test_runbook.py::test_respond_rewinds_skips_and_records_everything",),
    ),
    M(
        "group_hung_when_any_process_is",
        "the group counts as hung as soon as one process is overdue",
        (
            (
                "trainer/supervise/supervisor.py",
                "phase, since, step, process = min(beats,",
                "phase, since, step, process = max(beats,",
            ),
        ),
        ("tests/test_multihost.py::test_a_peer_waiting_for_a_slow_save_is_not_a_hang",),
    ),
    M(
        "params_sha256_of_the_wrong_tree",
        "summary.json's params_sha256 hashes the optimizer state",
        (
            (
                "trainer/core/endings.py",
                'digest = params_sha256(st["params"])',
                'digest = params_sha256(st["opt_state"])',
            ),
        ),
        ("tests/test_checkpoint.py::test_params_sha256_is_the_sha256_of_the_final_params",),
    ),
    M(
        "replica_check_disabled",
        "the replica check never reports a mismatch",
        (
            (
                "trainer/core/loop.py",
                'if (bad := w.replicas.check(st["params"])) is not None:',
                'if (bad := w.replicas.check(st["params"])) is not None and False:',
            ),
        ),
        ("tests/test_integrity.py::test_a_bitflip_in_one_replica_is_caught_rewound_and_the_run_ends_identical",),
    ),
    M(
        "manifest_not_verified",
        "restores skip the sha256 manifests",
        (("trainer/core/tiers.py", "ck.verify(step) if self.cfg.verify else None", "None"),),
        ("tests/test_integrity.py::test_a_bad_newest_checkpoint_is_rejected_and_the_previous_one_used[bytes_flipped]",),
    ),
    M(
        "seed_change_resumes",
        "a changed run.seed is not refused on resume",
        (
            (
                "trainer/config.py",
                'FROZEN_KEYS = ("model", "data.batch_size", "data.shuffle", "run.seed")',
                'FROZEN_KEYS = ("model", "data.batch_size", "data.shuffle")',
            ),
        ),
        ("tests/test_config.py::test_bad_input_exits_2_with_one_line_and_leaves_the_run_dir_untouched",),
    ),
    M(
        "shuffle_change_resumes",
        "a changed data.shuffle is not refused on resume",
        (
            (
                "trainer/config.py",
                'FROZEN_KEYS = ("model", "data.batch_size", "data.shuffle", "run.seed")',
                'FROZEN_KEYS = ("model", "data.batch_size", "run.seed")',
            ),
        ),
        ("tests/test_config.py::test_bad_input_exits_2_with_one_line_and_leaves_the_run_dir_untouched",),
    ),
    M(
        "data_change_resumes",
        "a resume on other training data is not refused",
        (
            (
                "trainer/core/worker.py",
                'if saved["data_fingerprint"] != fingerprint:',
                'if saved["data_fingerprint"] != fingerprint and False:',
            ),
        ),
        ("tests/test_eval.py::test_an_imported_token_file_trains_and_a_small_vocab_is_refused",),
    ),
    M(
        "no_restart_budget",
        "supervisor.max_restarts is never enforced",
        (
            (
                "trainer/supervise/supervisor.py",
                "if restarts >= self.sc.max_restarts:",
                "if restarts >= self.sc.max_restarts and False:",
            ),
        ),
        ("tests/test_supervisor.py::test_the_restart_budget_ends_the_run_with_exit_77_after_bounded_backoff",),
    ),
    M(
        "backoff_not_exponential",
        "the restart delay does not double for a step that keeps failing",
        (
            (
                "trainer/supervise/supervisor.py",
                "self.sc.backoff_s * 2 ** (same_step_failures - 2)",
                "self.sc.backoff_s * 1 ** (same_step_failures - 2)",
            ),
        ),
        ("tests/test_supervisor.py::test_the_restart_budget_ends_the_run_with_exit_77_after_bounded_backoff",),
    ),
    M(
        "backoff_unbounded",
        "the restart delay ignores supervisor.backoff_max_s",
        (
            (
                "trainer/supervise/supervisor.py",
                "self.sc.backoff_s * 2 ** (same_step_failures - 2), self.sc.backoff_max_s)",
                "self.sc.backoff_s * 2 ** (same_step_failures - 2), float('inf'))",
            ),
        ),
        ("tests/test_supervisor.py::test_the_restart_budget_ends_the_run_with_exit_77_after_bounded_backoff",),
    ),
    M(
        "signal_fault_ignores_its_signal",
        "the signal fault always sends SIGKILL",
        (
            (
                "trainer/supervise/faults.py",
                "os.kill(os.getpid(), getattr(signal, f.signal))",
                "os.kill(os.getpid(), signal.SIGKILL)",
            ),
        ),
        ("tests/test_status_report.py::test_status_and_report_while_running_and_after_restarts",),
    ),
    M(
        "recompute_counted_as_productive",
        "the goodput ledger counts recomputed steps as productive",
        (
            (
                "trainer/observe/goodput.py",
                'secs["recompute" if e["step"] <= best else "productive"]',
                'secs["recompute" if e["step"] < best else "productive"]',
            ),
        ),
        ("tests/test_status_report.py::test_the_goodput_ledger_puts_known_seconds_in_each_category",),
    ),
    M(
        "health_off_ignored",
        "log.health=false still starts the health collector and alerts",
        (("trainer/observe/alerts.py", "    if not cfg.log.health:\n        return []\n", ""),),
        ("tests/test_eval.py::test_eval_never_changes_training_and_its_loss_falls",),
    ),
    M(
        "audit_cli_exits_0_on_problems",
        "`trainer audit` exits 0 although it found problems",
        (("trainer/observe/audit.py", "return 1 if rep.problems else 0", "return 0"),),
        ("tests/test_multihost.py::test_audit_catches_overlapping_shards",),
    ),
    M(
        "no_tensorboard_markers",
        "restart and runbook markers are not written to TensorBoard",
        (("trainer/observe/alerts.py", '            scalars.add(e["step"], {f"markers/{name}": 1.0})\n', ""),),
        ("tests/test_runbook_e2e.py::test_a_recurring_spike_softens_and_a_persistent_one_gives_up",),
    ),
    M(
        "tensorboard_imports_torch",
        "the TensorBoard writer lets tensorboardX import torch (seconds a start)",
        (("trainer/observe/tensorboard.py", '    hide = "torch" not in sys.modules', "    hide = False"),),
        ("tests/test_dashboard.py::test_the_tensorboard_writer_does_not_import_torch",),
    ),
    M(
        "later_attempts_not_dashed",
        "the loss plot draws a restarted attempt's steps like the first attempt's",
        (("trainer/observe/report.py", 'ls="-" if drawn == 0 else "--",', 'ls="-",'),),
        ("tests/test_status_report.py::test_status_and_report_while_running_and_after_restarts",),
    ),
]


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


def run(m: Mutation, timeout: float) -> list[tuple[str, str, float, str]]:
    """(test, outcome, seconds, why) for each test of the mutation; outcome: caught | MISSED | timeout;
    why: the first line of the failure."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as d:
        dest = Path(d)
        _copy(dest)
        _apply(dest, m)
        xml = dest / "junit.xml"
        env = dict(os.environ, PYTHONPATH=str(dest), PYTHONUNBUFFERED="1")
        t0 = time.time()
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *m.tests]
        try:
            subprocess.run(
                cmd, cwd=dest, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout
            )
        except subprocess.TimeoutExpired:  # the tests did not pass in time under the bug
            return [(t, "timeout", time.time() - t0, f"still running after {timeout:.0f}s") for t in m.tests]
        if not xml.is_file():
            return [(t, "error", time.time() - t0, "pytest wrote no report") for t in m.tests]
        out = []
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            bad = case.find("failure")
            bad = bad if bad is not None else case.find("error")
            why = "" if bad is None else " ".join((bad.get("message") or "").split())[:140]
            out.append((name, "MISSED" if bad is None else "caught", float(case.get("time", 0)), why))
        return out or [(t, "error", time.time() - t0, "no test ran") for t in m.tests]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="mutations to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--out", help="also write the table (markdown) here")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per mutation")
    args = p.parse_args()
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:38} {m.what}")
        return 0
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    if unknown := set(args.names) - {m.name for m in MUTATIONS}:
        raise SystemExit(f"unknown mutation(s): {', '.join(sorted(unknown))} (see --list)")
    rows, missed = [], []
    for m in chosen:
        results = run(m, args.timeout)
        for test, outcome, secs, why in results:
            why = why.replace("|", "/").replace("`", "'")
            rows.append(f"| `{m.name}` | {m.what} | `{test}` | {outcome} | {secs:.0f} | {why} |")
            print(rows[-1], flush=True)
        if not any(outcome in ("caught", "timeout") for _, outcome, _, _ in results):
            missed.append(m.name)
    table = ["| mutation | the bug | test | caught? | test s | how it failed |", "|---|---|---|---|---:|---|", *rows]
    print("\n".join(table))
    if args.out:
        cmd = "python tests/mutate.py " + " ".join(sys.argv[1:])
        Path(args.out).write_text(f"# Mutations\n\nCommand: `{cmd}`\n\n" + "\n".join(table) + "\n")
    if missed:
        print(f"not caught: {', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
