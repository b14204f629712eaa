"""The planted bugs tests/mutate.py runs (data only): each a plausible bug, the edits that plant it, the tests
that should catch it and the assertion designed to (`catch`: a substring of the statement the failure must be
raised at; a failure anywhere else is incidental). Edits name text that must occur exactly once, so an entry
fails loudly when the code it mutates has moved."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the bug, in words
    edits: tuple[tuple[str, str, str], ...]  # (file, old, new)
    tests: tuple[str, ...]  # pytest node ids that should catch it
    catch: str = ""  # a substring of the assert statement designed to catch it (a failure elsewhere is incidental)


M = Mutation
MUTATIONS = [
    M(
        "prng_key_not_restored",
        "the checkpoint saves the dropout PRNG key as zeros",
        (
            (
                "trainer/train/loop.py",
                "blocking = w.ckpt.save(step, st, {",
                "blocking = w.ckpt.save(step, dict(st, rng=st['rng'] * 0), {",
            ),
        ),
        ("tests/test_resume.py::test_stop_and_resume_is_bit_identical[data8_dropout]",),
        catch='summary(run)["params_sha256"] == summary(ref)["params_sha256"]',
    ),
    M(
        "data_cursor_off_by_one",
        "a resumed data iterator starts one batch early (the batch before the checkpoint is trained on twice)",
        (
            (
                "trainer/train/loop.py",
                'it.set_state({"next_index": start})',
                'it.set_state({"next_index": start - 1 if start else start})',
            ),
        ),
        ("tests/test_resume.py::test_stop_and_resume_is_bit_identical[fsdp8_microbatches2]",),
        catch='summary(run)["params_sha256"] == summary(ref)["params_sha256"]',
    ),
    M(
        "fallback_to_oldest",
        "after rejecting the newest checkpoint the restore takes the oldest, not the previous",
        (
            (
                "trainer/ckpt/tiers.py",
                "            self._move_aside(tier, step, verdict)\n",
                "            self._move_aside(tier, step, verdict)\n            self.fell_back = True\n",
            ),
            (
                "trainer/ckpt/tiers.py",
                "return max(holdings.candidates(views), key=lambda c: (c.step, c.tier == LOCAL), default=None)",
                "return (min if getattr(self, 'fell_back', False) else max)"
                "(holdings.candidates(views), key=lambda c: (c.step, c.tier == LOCAL), default=None)",
            ),
        ),
        tuple(
            f"tests/test_integrity.py::test_a_bad_newest_checkpoint_is_rejected_and_the_previous_one_used[{how}]"
            for how in ("bytes_flipped", "deleted", "meta_torn", "truncated", "unsealed")
        ),
        catch='== [(15, "durable")]',
    ),
    M(
        "torn_meta_crashes_the_resume_check",
        "a torn metadata item in the newest checkpoint is read outside the "
        "fallback path (the resume check raises instead of asking an older checkpoint)",
        (
            (
                "trainer/ckpt/tiers.py",
                "        except Exception:  # torn or corrupt: an older one answers the same question",
                "        except FileNotFoundError:  # torn or corrupt: an older one answers the same question",
            ),
        ),
        ("tests/test_integrity.py::test_a_bad_newest_checkpoint_is_rejected_and_the_previous_one_used[meta_torn]",),
        catch='== [(20, "durable", bad_file)]',
    ),
    M(
        "synchronous_save",
        "Orbax saves synchronously (the loop blocks until the checkpoint is written)",
        (
            (
                "trainer/ckpt/checkpoint.py",
                "enable_async_checkpointing=cfg.async_save,",
                "enable_async_checkpointing=False,",
            ),
        ),
        ("tests/test_checkpoint.py::test_saving_is_asynchronous_steps_go_on_while_slow_storage_commits",),
        catch="during and min(during) >= 10",
    ),
    M(
        "restore_timeout_is_step_timeout",
        "a hung restore is judged by the step timeout",
        (
            (
                "trainer/config/supervision.py",
                'RESTORE = "restore", "restore_timeout_s"',
                'RESTORE = "restore", "step_timeout_s"',
            ),
        ),
        ("tests/test_supervisor.py::test_hangs_in_every_phase_are_detected_by_their_own_timeout_dumped_and_recovered",),
        catch='[(h["phase"], h["step"], h["timeout_s"]) for h in hangs] ==',
    ),
    M(
        "startup_timeout_is_step_timeout",
        "a worker hung while starting is judged by the step timeout",
        (
            (
                "trainer/config/supervision.py",
                'STARTUP = "startup", "startup_timeout_s"',
                'STARTUP = "startup", "step_timeout_s"',
            ),
        ),
        ("tests/test_supervisor.py::test_hangs_in_every_phase_are_detected_by_their_own_timeout_dumped_and_recovered",),
        catch='[(h["phase"], h["step"], h["timeout_s"]) for h in hangs] ==',
    ),
    M(
        "checkpoint_timeout_is_step_timeout",
        "a hung checkpoint write is judged by the step timeout",
        (
            (
                "trainer/config/supervision.py",
                'CHECKPOINT = "checkpoint", "checkpoint_timeout_s"',
                'CHECKPOINT = "checkpoint", "step_timeout_s"',
            ),
        ),
        ("tests/test_supervisor.py::test_hangs_in_every_phase_are_detected_by_their_own_timeout_dumped_and_recovered",),
        catch='[(h["phase"], h["step"], h["timeout_s"]) for h in hangs] ==',
    ),
    M(
        "compile_timeout_is_step_timeout",
        "a hung compile is judged by the step timeout",
        (
            (
                "trainer/config/supervision.py",
                'COMPILE = "compile", "startup_timeout_s"',
                'COMPILE = "compile", "step_timeout_s"',
            ),
        ),
        ("tests/test_supervisor.py::test_hangs_in_every_phase_are_detected_by_their_own_timeout_dumped_and_recovered",),
        catch='[(h["phase"], h["step"], h["timeout_s"]) for h in hangs] ==',
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
        catch='at_save == [["20", "40"]]',
    ),
    M(
        "group_hung_when_any_process_is",
        "the group counts as hung as soon as one process is overdue",
        (
            (
                "trainer/supervise/hang.py",
                "least = min(beats,",
                "least = max(beats,",
            ),
        ),
        ("tests/test_multihost.py::test_a_peer_waiting_for_a_slow_save_is_not_a_hang",),
        catch='e["event"] == E.HANG_DETECTED',
    ),
    M(
        "params_sha256_of_the_wrong_tree",
        "summary.json's params_sha256 hashes the optimizer state",
        (
            (
                "trainer/train/endings.py",
                'digest = params_sha256(st["params"])',
                'digest = params_sha256(st["opt_state"])',
            ),
        ),
        ("tests/test_checkpoint.py::test_params_sha256_is_the_sha256_of_the_final_params",),
        catch='summary(run)["params_sha256"] == h.hexdigest()',
    ),
    M(
        "replica_check_disabled",
        "the replica check never reports a mismatch",
        (
            (
                "trainer/train/loop.py",
                'if (bad := w.replicas.check(st["params"])) is not None:',
                'if (bad := w.replicas.check(st["params"])) is not None and False:',
            ),
        ),
        ("tests/test_integrity.py::test_a_bitflip_in_one_replica_is_caught_rewound_and_the_run_ends_identical",),
        catch="E.REPLICA_MISMATCH",
    ),
    M(
        "manifest_not_verified",
        "restores skip the sha256 manifests",
        (("trainer/ckpt/tiers.py", "self.durable.verify(step) if self.cfg.verify else None", "None"),),
        ("tests/test_integrity.py::test_a_bad_newest_checkpoint_is_rejected_and_the_previous_one_used[bytes_flipped]",),
        catch='== [(20, "durable", bad_file)]',
    ),
    M(
        "seed_change_resumes",
        "a changed run.seed is not refused on resume",
        (
            (
                "trainer/config/__init__.py",
                'FROZEN_KEYS = ("model", "data.batch_size", "data.shuffle", "run.seed")',
                'FROZEN_KEYS = ("model", "data.batch_size", "data.shuffle")',
            ),
        ),
        ("tests/test_config.py::test_bad_input_exits_2_with_one_line_and_leaves_the_run_dir_untouched",),
        catch="proc.returncode == 2",
    ),
    M(
        "shuffle_change_resumes",
        "a changed data.shuffle is not refused on resume",
        (
            (
                "trainer/config/__init__.py",
                'FROZEN_KEYS = ("model", "data.batch_size", "data.shuffle", "run.seed")',
                'FROZEN_KEYS = ("model", "data.batch_size", "run.seed")',
            ),
        ),
        ("tests/test_config.py::test_bad_input_exits_2_with_one_line_and_leaves_the_run_dir_untouched",),
        catch="proc.returncode == 2",
    ),
    M(
        "data_change_resumes",
        "a resume on other training data is not refused",
        (
            (
                "trainer/train/worker.py",
                'if saved["data_fingerprint"] != fingerprint:',
                'if saved["data_fingerprint"] != fingerprint and False:',
            ),
        ),
        ("tests/test_eval.py::test_an_imported_token_file_trains_and_a_small_vocab_is_refused",),
        catch='"the training data changed" in other.stderr',
    ),
    M(
        "no_restart_budget",
        "supervisor.max_restarts is never enforced",
        (
            (
                "trainer/supervise/exit_codes.py",
                "if tally.restarts >= sc.max_restarts:",
                "if tally.restarts >= sc.max_restarts and False:",
            ),
        ),
        ("tests/test_supervisor.py::test_the_restart_budget_ends_the_run_with_exit_77_after_bounded_backoff",),
        catch="proc.returncode == exit_codes.RESTART_BUDGET",
    ),
    M(
        "backoff_not_exponential",
        "the restart delay does not double for a step that keeps failing",
        (
            (
                "trainer/supervise/exit_codes.py",
                "sc.backoff_s * 2 ** (tries - 2)",
                "sc.backoff_s * 1 ** (tries - 2)",
            ),
        ),
        ("tests/test_supervisor.py::test_the_restart_budget_ends_the_run_with_exit_77_after_bounded_backoff",),
        catch="== [0.0, 0.2, 0.4, 0.5]",
    ),
    M(
        "backoff_unbounded",
        "the restart delay ignores supervisor.backoff_max_s",
        (
            (
                "trainer/supervise/exit_codes.py",
                "sc.backoff_s * 2 ** (tries - 2), sc.backoff_max_s)",
                "sc.backoff_s * 2 ** (tries - 2), float('inf'))",
            ),
        ),
        ("tests/test_supervisor.py::test_the_restart_budget_ends_the_run_with_exit_77_after_bounded_backoff",),
        catch="== [0.0, 0.2, 0.4, 0.5]",
    ),
    M(
        "signal_fault_ignores_its_signal",
        "the signal fault always sends SIGKILL",
        (
            (
                "trainer/faults/injector.py",
                "os.kill(os.getpid(), getattr(signal, f.signal))",
                "os.kill(os.getpid(), signal.SIGKILL)",
            ),
        ),
        ("tests/test_status_report.py::test_status_and_report_while_running_and_after_restarts",),
        catch='died["signal"] == "SIGUSR2"',
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
        catch="secs == {",
    ),
    M(
        "health_off_ignored",
        "log.health=false still starts the health collector and alerts",
        (("trainer/observe/alerts.py", "    if not cfg.log.health:\n        return []\n", ""),),
        ("tests/test_eval.py::test_eval_never_changes_training_and_its_loss_falls",),
        catch="({E.HEALTH_SOURCE, E.HEALTH} <= kinds) == on",
    ),
    M(
        "audit_cli_exits_0_on_problems",
        "`trainer audit` exits 0 although it found problems",
        (("trainer/observe/audit.py", "return 1 if rep.problems else 0", "return 0"),),
        ("tests/test_multihost.py::test_audit_catches_overlapping_shards",),
        catch='p.returncode == 1 and "overlapping shards"',
    ),
    M(
        "no_tensorboard_markers",
        "restart and runbook markers are not written to TensorBoard",
        (("trainer/observe/alerts.py", '            scalars.add(e["step"], {f"markers/{name}": 1.0})\n', ""),),
        ("tests/test_runbook_e2e.py::test_a_recurring_spike_softens_and_a_persistent_one_gives_up",),
        catch='tb.Scalars(f"markers/{name}")',
    ),
    M(
        "tensorboard_imports_torch",
        "the TensorBoard writer lets tensorboardX import torch (seconds a start)",
        (("trainer/observe/tensorboard.py", '    hide = "torch" not in sys.modules', "    hide = False"),),
        ("tests/test_dashboard.py::test_the_tensorboard_writer_does_not_import_torch",),
        catch='out.stdout.strip() == "False"',
    ),
    M(
        "later_attempts_not_dashed",
        "the loss plot draws a restarted attempt's steps like the first attempt's",
        (("trainer/observe/report.py", 'ls="-" if drawn == 0 else "--",', 'ls="-",'),),
        ("tests/test_status_report.py::test_status_and_report_while_running_and_after_restarts",),
        catch='ln.get_linestyle() for ln in series] == ["-", "--"]',
    ),
    # --- checkpoint tiers and integrity: tests/test_tiers.py, tests/test_integrity.py ---
    M(
        "local_tie_goes_to_durable",
        "at equal steps the restore takes the durable checkpoint, not the local copy",
        (
            (
                "trainer/ckpt/tiers.py",
                "key=lambda c: (c.step, c.tier == LOCAL), default=None)",
                "key=lambda c: (c.step, c.tier == DURABLE), default=None)",
            ),
        ),
        ("tests/test_tiers.py::test_at_the_same_step_the_local_copy_is_restored",),
        catch="== (10, LOCAL, 10.5)",
    ),
    M(
        "local_copy_of_another_mesh_used",
        "a local copy saved under another mesh is restored",
        (("trainer/ckpt/tiers.py", ' or meta.mesh != layout["mesh"]:', ":"),),
        ("tests/test_tiers.py::test_a_local_copy_is_used_only_with_the_mesh_and_process_count_it_was_saved_under",),
        catch='"another mesh"',
    ),
    M(
        "local_copy_of_another_process_count_used",
        "a local copy saved with another process count is restored",
        (("trainer/ckpt/tiers.py", 'meta.processes != layout["processes"] or ', ""),),
        ("tests/test_tiers.py::test_a_local_copy_is_used_only_with_the_mesh_and_process_count_it_was_saved_under",),
        catch='"another process count"',
    ),
    M(
        "rewound_local_copy_used",
        "a local copy from the history the runbook rewound away from is restored",
        (
            (
                "trainer/ckpt/tiers.py",
                "stale = any(to < step for to in self.rewinds[meta.lineage :])",
                "stale = False",
            ),
        ),
        ("tests/test_tiers.py::test_a_local_copy_from_a_history_the_runbook_rewound_away_from_is_never_used",),
        catch="the rewound-away copy of 12 was used",
    ),
    M(
        "lineage_not_saved",
        "local saves do not record how many rewinds preceded them: a copy saved after a rewind counts as rewound away",
        (("trainer/ckpt/tiers.py", "meta = dict(meta, lineage=len(self.rewinds))", "meta = dict(meta)"),),
        ("tests/test_tiers.py::test_a_local_copy_from_a_history_the_runbook_rewound_away_from_is_never_used",),
        catch="a copy saved after the rewind was passed over",
    ),
    M(
        "local_failure_keeps_the_tier_on",
        "a failed local save leaves the local tier on: every later local save fails again",
        (
            (
                "trainer/ckpt/tiers.py",
                'action="local tier off until restart")\n        self.local = None\n',
                'action="local tier off until restart")\n',
            ),
        ),
        (
            "tests/test_integrity.py::test_a_local_save_that_fails_turns_the_local_tier_off_and_the_durable_tier_goes_on",
        ),
        catch="failed == [(LOCAL, True)]",
    ),
    M(
        "local_failure_stops_the_run",
        "a failed local save ends the run like a failed durable one (exit 81)",
        (
            (
                "trainer/ckpt/tiers.py",
                "        return self.durable.failure\n",
                "        return self.durable.failure or (self.local and self.local.failure)\n",
            ),
        ),
        (
            "tests/test_integrity.py::test_a_local_save_that_fails_turns_the_local_tier_off_and_the_durable_tier_goes_on",
        ),
        catch="a local failure stops the run",
    ),
    M(
        "restore_reads_not_retried",
        "a possibly transient error while Orbax reads a checkpoint is not retried",
        (("trainer/ckpt/tiers.py", "        manifest.retrying(load)\n", "        load()\n"),),
        ("tests/test_integrity.py::test_possibly_transient_read_errors_are_retried_and_others_are_not",),
        catch="a transient error on the restore path was not retried",
    ),
    M(
        "retry_waits_do_not_double",
        "retries wait 1, 1, 1 s instead of 1, 2, 4 s",
        (("trainer/store/manifest.py", "time.sleep(wait_s * 2**attempt)", "time.sleep(wait_s)"),),
        ("tests/test_integrity.py::test_possibly_transient_read_errors_are_retried_and_others_are_not",),
        catch="the waits do not double",
    ),
    M(
        "retry_waits_start_shorter",
        "the first retry waits 0.5 s, not the README's 1 s",
        (("trainer/store/manifest.py", "RETRIES, RETRY_WAIT_S = 3, 1.0", "RETRIES, RETRY_WAIT_S = 3, 0.5"),),
        ("tests/test_integrity.py::test_possibly_transient_read_errors_are_retried_and_others_are_not",),
        catch="calls[1] - calls[0] >= 1.0",
    ),
    M(
        "two_retries",
        "a possibly transient read error is retried twice, not 3 times",
        (("trainer/store/manifest.py", "RETRIES, RETRY_WAIT_S = 3, 1.0", "RETRIES, RETRY_WAIT_S = 2, 1.0"),),
        ("tests/test_integrity.py::test_possibly_transient_read_errors_are_retried_and_others_are_not",),
        catch="not 3 retries by default",
    ),
    M(
        "verify_false_writes_manifests",
        "checkpoint.verify=false still writes content manifests",
        (
            (
                "trainer/ckpt/checkpoint.py",
                "            if self.cfg.verify:\n                manifest.write(",
                "            if True:\n                manifest.write(",
            ),
        ),
        (
            "tests/test_tiers.py::test_verify_false_writes_no_manifests_and_restores_without_them_verify_true_requires_them",
        ),
        catch="a manifest was written with verify=false",
    ),
    M(
        "verify_false_checks_durable",
        "checkpoint.verify=false still requires manifests of a durable checkpoint",
        (
            (
                "trainer/ckpt/tiers.py",
                "self.durable.verify(step) if self.cfg.verify else None",
                "self.durable.verify(step)",
            ),
        ),
        (
            "tests/test_tiers.py::test_verify_false_writes_no_manifests_and_restores_without_them_verify_true_requires_them",
        ),
        catch="verify=false: the durable one was not trusted",
    ),
    M(
        "verify_false_checks_local",
        "checkpoint.verify=false still requires manifests of a local copy",
        (
            (
                "trainer/ckpt/tiers.py",
                "        if not self.cfg.verify:\n            return None\n        for folder in folders:",
                "        for folder in folders:",
            ),
        ),
        (
            "tests/test_tiers.py::test_verify_false_writes_no_manifests_and_restores_without_them_verify_true_requires_them",
        ),
        catch="verify=false: the local copy without manifests was not trusted",
    ),
    M(
        "durable_load_failure_not_rejected",
        "a durable checkpoint that verifies but fails to load ends the restore (the run starts from scratch)",
        (
            (
                "trainer/ckpt/tiers.py",
                "restored, verdict = self._restore(self.durable, step, abstract_state)",
                "restored, _ = self._restore(self.durable, step, abstract_state)",
            ),
        ),
        (
            "tests/test_tiers.py::test_a_checkpoint_that_verifies_but_does_not_load_is_rejected_and_the_previous_one_used",
        ),
        catch="a checkpoint that did not load was used",
    ),
    M(
        "local_load_failure_not_rejected",
        "a local copy that verifies but fails to load is not rejected",
        (
            (
                "trainer/ckpt/tiers.py",
                "return p and manifest.Problem(f\"{got.get('reading', '')}/\", p.reason)",
                "return None",
            ),
        ),
        (
            "tests/test_tiers.py::test_a_checkpoint_that_verifies_but_does_not_load_is_rejected_and_the_previous_one_used",
        ),
        catch="a checkpoint that did not load was used",
    ),
    M(
        "storage_exit_without_event",
        "a durable save on a full disk ends the run without a checkpoint_failed event",
        (
            (
                "trainer/train/endings.py",
                "    w.events.write(CHECKPOINT_FAILED, step=step, tier=DURABLE, message=msg)\n",
                "",
            ),
        ),
        ("tests/test_integrity.py::test_a_full_disk_is_waited_out_and_the_run_resumes_on_its_own",),
        catch="no checkpoint_failed event",
    ),
    M(
        "heartbeat_raises_on_a_full_disk",
        "a heartbeat write on a full disk raises (the worker dies) instead of being dropped",
        (
            (
                "trainer/observe/heartbeat.py",
                "a real hang is still caught by its age\n            if e.errno not in NO_SPACE:",
                "a real hang is still caught by its age\n            if True:",
            ),
        ),
        ("tests/test_integrity.py::test_heartbeats_and_pulses_survive_a_full_disk",),
        catch="out.returncode == 0",
    ),
    M(
        "pulse_dies_on_a_full_disk",
        "the pulse thread dies on a full disk (the supervisor then sees a frozen process)",
        (
            (
                "trainer/observe/heartbeat.py",
                "            if e.errno not in NO_SPACE:\n                raise\n\n    def _pulse_forever",
                "            raise\n\n    def _pulse_forever",
            ),
        ),
        ("tests/test_integrity.py::test_heartbeats_and_pulses_survive_a_full_disk",),
        catch="== [1, 3, True]",
    ),
    M(
        "no_replica_check_before_a_save",
        "the replica check runs only every N steps, not before every save (a corrupt state can be saved)",
        (
            (
                "trainer/train/loop.py",
                "if _replicas_due(w, step, saving=save is not None):",
                "if _replicas_due(w, step, saving=False):",
            ),
        ),
        ("tests/test_integrity.py::test_a_bitflip_in_one_replica_is_caught_rewound_and_the_run_ends_identical",),
        catch='last_good"]) for m in _of(run, E.REPLICA_MISMATCH)] == [(20, 14)]',
    ),
    M(
        "no_periodic_replica_check",
        "the replica check runs only before saves, not every N steps",
        (("trainer/train/loop.py", "(saving or step % w.cfg.integrity.replica_check_steps == 0)", "(saving)"),),
        ("tests/test_integrity.py::test_a_bitflip_in_one_replica_is_caught_rewound_and_the_run_ends_identical",),
        catch='last_good"]) for m in _of(run, E.REPLICA_MISMATCH)] == [(20, 14)]',
    ),
    M(
        "replica_rewind_keeps_newer_checkpoints",
        "the replica rewind keeps the checkpoints saved after the last step whose replicas agreed",
        (
            (
                "trainer/supervise/replica_rewind.py",
                'runbook.rewind(run_dir, e["last_good"] + 1, f"replica{tag}")',
                'runbook.rewind(run_dir, e["step"] + 1, f"replica{tag}")',
            ),
        ),
        ("tests/test_integrity.py::test_the_replica_rewind_moves_checkpoints_newer_than_the_last_good_step_aside",),
        catch="checkpoints newer than last_good were kept",
    ),
    # --- export, sample, init_from, prepare, the data cache, inspect, run.deterministic ---
    M(
        "export_into_a_non_empty_out",
        "export accepts an existing non-empty --out (then fails renaming onto it, with a traceback)",
        (
            (
                "trainer/tools/export.py",
                "if out.exists() and not (out.is_dir() and not any(out.iterdir())):",
                "if out.exists() and not out.is_dir():",
            ),
        ),
        ("tests/test_export.py::test_export_creates_missing_parents_atomically_and_refuses_a_non_empty_out",),
        catch='p.returncode == 2 and p.stderr.count("\\n") == 1',
    ),
    M(
        "export_imports_torch",
        "export imports torch (README: neither torch nor transformers is needed to export)",
        (
            (
                "trainer/tools/export.py",
                "    from safetensors.numpy import save_file\n",
                "    import torch  # noqa: F401\n    from safetensors.numpy import save_file\n",
            ),
        ),
        ("tests/test_export.py::test_export_creates_missing_parents_atomically_and_refuses_a_non_empty_out",),
        catch="blocked.returncode == 0",
    ),
    M(
        "sample_top_k_ignored",
        "`sample --top-k` is not passed to the decoder (draws from every token)",
        (("trainer/tools/sample.py", "        top_k=args.top_k,\n", "        top_k=0,\n"),),
        ("tests/test_export.py::test_sample_top_k_seed_and_an_empty_prompt",),
        catch='top1["new_ids"] == generate(loaded, [eos]',
    ),
    M(
        "sample_seed_ignored",
        "`sample --seed` is not passed to the decoder (every seed draws seed 0's text)",
        (("trainer/tools/sample.py", "        seed=args.seed,\n", "        seed=0,\n"),),
        ("tests/test_export.py::test_sample_top_k_seed_and_an_empty_prompt",),
        catch='hot["new_ids"] == generate(loaded, hot["prompt_ids"], seed=1',
    ),
    M(
        "sample_empty_prompt_not_eos",
        '`sample --prompt ""` starts from token 0 instead of end-of-text',
        (("trainer/tools/sample.py", "or [tok.eos_id]", "or [0]"),),
        ("tests/test_export.py::test_sample_top_k_seed_and_an_empty_prompt",),
        catch='top1["prompt_ids"] == [eos]',
    ),
    M(
        "sample_default_temperature",
        "`sample` is greedy by default, not the README's temperature 0.8",
        (("trainer/tools/sample.py", 'default=0.8, metavar="T"', 'default=0.0, metavar="T"'),),
        ("tests/test_export.py::test_a_prepared_tokenizer_is_exported_and_sample_uses_it",),
        catch='got["new_ids"] == want',
    ),
    M(
        "init_from_step_dir_takes_newest",
        "train.init_from=RUN_DIR/checkpoints/STEP is read as its run dir: the newest checkpoint's params",
        (("trainer/observe/pick.py", "        return run, int(path.name)\n", "        return run, None\n"),),
        ("tests/test_export.py::test_init_from_a_step_dir_takes_that_checkpoints_params",),
        catch='src["from_step"] == older',
    ),
    M(
        "prepare_dir_skips_record_files",
        "a directory --input reads only its text files (its .jsonl/.parquet files are left out)",
        (
            (
                "trainer/corpus/sources.py",
                "    suffixes = TEXT_SUFFIXES + RECORD_SUFFIXES\n",
                "    suffixes = TEXT_SUFFIXES\n",
            ),
        ),
        ("tests/test_prepare.py::test_a_text_file_is_one_document_and_a_directory_reads_records_one_each",),
        catch='_tokens(mixed, "train").tolist() == want.tolist()',
    ),
    M(
        "prepare_text_file_split_into_paragraphs",
        "a text file is cut into documents at blank lines instead of being one document",
        (
            (
                "trainer/corpus/sources.py",
                "                yield f.read_bytes()\n",
                '                yield from f.read_bytes().split(b"\\n\\n")\n',
            ),
        ),
        ("tests/test_prepare.py::test_a_text_file_is_one_document_and_a_directory_reads_records_one_each",),
        catch='_tokens(one, "train").tolist() == eos(text).tolist()',
    ),
    M(
        "prepare_always_uint16",
        "prepare writes uint16 shards whatever the vocabulary (ids past 65535 wrap around)",
        (("trainer/corpus/prepare.py", "    dtype = shards.dtype_for(tok.vocab_size)\n", '    dtype = "uint16"\n'),),
        ("tests/test_prepare.py::test_a_vocabulary_past_65536_gets_uint32_shards_checked_at_start",),
        catch='m["dtype"] == "uint32"',
    ),
    M(
        "shard_size_unchecked_at_start",
        "a training start checks only that each shard exists, not its size against meta.json",
        (("trainer/corpus/shards.py", '        if size != s["n_tokens"] * item:\n', "        if size < 0:\n"),),
        ("tests/test_prepare.py::test_a_vocabulary_past_65536_gets_uint32_shards_checked_at_start",),
        catch="the prepared data is damaged",
    ),
    M(
        "cache_wait_ignores_the_lock",
        "a process waiting for the data cache ignores process 0's lock: it gives up while process 0 still prepares",
        (
            (
                "trainer/corpus/cache.py",
                "        fd = _lock(dest, fcntl.LOCK_SH | fcntl.LOCK_NB)\n",
                "        fd = os.open(os.devnull, os.O_RDONLY)\n",
            ),
        ),
        ("tests/test_prepare.py::test_a_process_waiting_for_an_unshared_cache_says_so_after_the_wait",),
        catch="t.is_alive() and not said",
    ),
    M(
        "cache_wait_never_gives_up",
        "a process waiting on an unshared data cache restarts its clock every poll: it never says so, it hangs",
        (
            (
                "trainer/corpus/cache.py",
                "            free_since = free_since or time.monotonic()\n",
                "            free_since = time.monotonic()\n",
            ),
        ),
        ("tests/test_prepare.py::test_a_process_waiting_for_an_unshared_cache_says_so_after_the_wait",),
        catch="data.cache_dir must be shared by all processes",
    ),
    M(
        "deterministic_ignored",
        "run.deterministic does not add XLA's deterministic-ops flag",
        (
            (
                "trainer/xla_env.py",
                "((run.deterministic, DETERMINISTIC_FLAG),",
                "((False, DETERMINISTIC_FLAG),",
            ),
        ),
        ("tests/test_first_hour.py::test_run_deterministic_adds_its_flag_to_xla_flags",),
        catch='os.environ["XLA_FLAGS"] == "--xla_dump_hlo_as_text --xla_gpu_deterministic_ops=true"',
    ),
    M(
        "deterministic_drops_the_users_xla_flags",
        "run.deterministic replaces XLA_FLAGS with its flag (the user's own flags are lost)",
        (
            (
                "trainer/xla_env.py",
                'environ[env_vars.XLA_FLAGS] = " ".join([have, *add]).strip()',
                'environ[env_vars.XLA_FLAGS] = " ".join(add)',
            ),
        ),
        ("tests/test_first_hour.py::test_run_deterministic_adds_its_flag_to_xla_flags",),
        catch='os.environ["XLA_FLAGS"] == "--xla_dump_hlo_as_text --xla_gpu_deterministic_ops=true"',
    ),
    M(
        "mfu_ceiling_counts_whole_attention",
        "inspect's MFU ceiling takes the old model FLOPs (the whole L x L attention) as useful: it passes 100%",
        (
            (
                "trainer/tools/inspect.py",
                "    useful_flops = (useful.matmul_params + useful.attention) * tokens_per_device\n",
                "    useful_flops = model_full_attn\n",
            ),
        ),
        ("tests/test_sharding.py::test_inspect_mfu_ceiling_counts_useful_flops_and_cannot_pass_100_percent",),
        catch='ceiling["compute"] <= 1.0',
    ),
    M(
        "cublas_lt_calls_not_matmuls",
        "the HLO reader counts only legacy cuBLAS gemm calls as matmuls: a GPU's cuBLASLt matmuls drop out",
        (
            (
                "trainer/tools/hlo.py",
                'return target == "__cublas$gemm" or target.startswith("__cublas$lt$matmul")',
                'return target == "__cublas$gemm"',
            ),
        ),
        ("tests/test_hlo.py::test_cublas_custom_calls_count_as_matmuls_with_their_dtypes_and_flops",),
        catch='assert sorted(by_op) == ["__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8"]',
    ),
    M(
        "mfu_logged_with_whole_attention",
        "the step's mfu counts the whole L x L attention (PaLM's figure), not the causal half the anchors count",
        (
            (
                "trainer/train/step_log.py",
                'rec["mfu"] = tps * self.flops_per_token / self.peak',
                'rec["mfu"] = tps * self.flops_per_token_full_attn / self.peak',
            ),
        ),
        ("tests/test_first_hour.py::test_mfu_counts_attentions_causal_half_and_keeps_the_whole_beside_it",),
        catch='e["mfu"] < e["mfu_full_attn"]',
    ),
    M(
        "inspect_total_counts_all_reduce_twice",
        "inspect's collective total counts each all-reduce's bytes twice (a ring's wire bytes, not the dump's)",
        (
            (
                "trainer/tools/inspect.py",
                '"collective_bytes_total": stats.total_collective_bytes,',
                '"collective_bytes_total": stats.total_collective_bytes + stats.collective_bytes["all-reduce"],',
            ),
        ),
        ("tests/test_sharding.py::test_compiled_step_moves_what_the_plan_says",),
        catch='got["collective_bytes_total"], got["collective_bytes_per_step"]',
    ),
    # --- the loop, the PRNG key, the runbook, the audit, flags agreed by all processes ---
    M(
        "stopped_run_rerun_trains_again",
        "a run stopped at train.stop_at_step and re-run by the same command is handed to a worker (the "
        '"already finished" check compares the newest checkpoint with train.steps only)',
        (
            (
                "trainer/observe/outcome.py",
                "steps[-1] < (cfg.train.stop_at_step or cfg.train.steps)",
                "steps[-1] < cfg.train.steps",
            ),
        ),
        ("tests/test_resume.py::test_stop_and_resume_is_bit_identical[data8_dropout]",),
        catch="snapshot(run) == before",
    ),
    M(
        "loop_ignores_time_cadence",
        "the training loop never passes the time cadence (checkpoint.every_minutes) to the group's agreement",
        (("trainer/train/loop.py", "timed=due.durable,", "timed=False,"),),
        ("tests/test_save_policy.py::test_the_loop_asks_the_time_cadence_at_every_step",),
        catch='decided == [None, None, Save("durable", "periodic")',
    ),
    M(
        "microbatches_share_a_dropout_key",
        "every microbatch of a step draws its dropout from the same key",
        (
            (
                "trainer/train/step.py",
                "grad_fn(params, tokens_bL1, jax.random.fold_in(key, i))",
                "grad_fn(params, tokens_bL1, key)",
            ),
        ),
        ("tests/test_resume.py::test_each_microbatch_draws_its_own_dropout_key_and_each_step_advances_the_saved_one",),
        catch='float(ab["loss"]) != float(ba["loss"])',
    ),
    M(
        "prng_key_never_advances",
        "the train step hands back the PRNG key it was given (the saved key is then always the seed's)",
        (("trainer/train/step.py", '"rng": jax.random.key_data(next_key),', '"rng": state["rng"],'),),
        ("tests/test_resume.py::test_each_microbatch_draws_its_own_dropout_key_and_each_step_advances_the_saved_one",),
        catch="not np.array_equal(key1, key0)",
    ),
    M(
        "restore_ignores_saved_key",
        "a restore takes the PRNG key of a fresh init (the seed's) instead of the checkpoint's",
        (
            (
                "trainer/train/loop.py",
                "return restored.state, restored.step, restored.tier",
                'return dict(restored.state, rng=w.spec.init()["rng"]), restored.step, restored.tier',
            ),
        ),
        ("tests/test_resume.py::test_stop_and_resume_is_bit_identical[data8_dropout]",),
        catch='summary(run)["params_sha256"] == summary(ref)["params_sha256"]',
    ),
    M(
        "runbook_softened_lr_not_reapplied",
        "a worker restored after a soften trains with the checkpoint's LR scale, clip and b2, not runbook.json's",
        (
            (
                "trainer/train/loop.py",
                "st = optim.set_hyperparams(st, w.hyperparams)  # runbook.json wins",
                "pass  # runbook.json wins",
            ),
        ),
        ("tests/test_runbook_e2e.py::test_a_recurring_spike_softens_and_a_persistent_one_gives_up",),
        catch="at21[1] == at21[0] / 2",
    ),
    M(
        "runbook_softened_clip_not_applied",
        "a worker start reads runbook.json's LR scale and b2 but the config's clip norm",
        (
            (
                "trainer/supervise/runbook.py",
                'clip_norm=saved.get("clip_norm", optim.clip_norm),',
                "clip_norm=optim.clip_norm,",
            ),
        ),
        ("tests/test_runbook.py::test_respond_softens_on_recurrence_and_gives_up_saying_what_it_tried",),
        catch='hyperparams == {"lr_scale": 0.5, "clip_norm": 0.5, "b2": 0.9}',
    ),
    M(
        "audit_never_consumed_blind",
        "the audit counts a data batch as consumed when a step of its number was recorded, not when its "
        "samples were read (a cursor one batch late passes)",
        (("trainer/observe/audit.py", "consumed = {g // batch for g in where}", "consumed = set(steps)"),),
        ("tests/test_data.py::test_the_audit_names_a_batch_that_was_never_consumed",),
        catch="problems == [",
    ),
    M(
        "agree_and_not_or",
        "the group acts on a flag only when every process that published raised it (AND, not OR)",
        (
            (
                "trainer/parallel/agree.py",
                'verdict = "".join("1" if any(v[i] == "1" for v in seen)',
                'verdict = "".join("1" if all(v[i] == "1" for v in seen)',
            ),
        ),
        ("tests/test_agree.py::test_two_processes_act_on_the_same_flags_at_the_same_step",),
        catch="if v[0]] == [s for s in range(14 + lag, 23)]",
    ),
    M(
        "peer_stop_ends_as_done",
        "a process that did not get the SIGTERM stops with its peer but ends as a plain stop (exit 0), not "
        "preempted: the group's preemption reads as a finished run",
        (
            (
                "trainer/train/loop.py",
                "    flags.stop |= shared.stop  # a peer's SIGTERM stops this process too",
                "    pass  # a peer's SIGTERM stops this process too",
            ),
        ),
        ("tests/test_multihost.py::test_elastic_resume_on_another_process_count_keeps_the_global_order",),
        catch="[exit_codes.PREEMPTED] * 2",
    ),
    M(
        "hang_blame_ignores_pulses",
        "a hang is blamed on the process furthest behind, never on the one whose pulses stopped (a frozen node "
        "and its waiting peer look alike by their heartbeats)",
        (("trainer/supervise/hang.py", "    if frozen and len(frozen) < len(pulses):", "    if False:"),),
        # Since the frozen check (issue 44) names a stopped pulse in seconds, end to end the timeout's blame is
        # reached only when no peer's pulse was fresh: the unit test sets that up (the node-loss test no
        # longer reaches this line: its frozen node is named by the frozen check).
        (
            "tests/test_downtime.py::test_a_hang_is_blamed_on_the_process_whose_pulse_stopped_else_the_one_furthest_behind",
        ),
        catch='(i, node) == (1, "n1") and "froze" in why',
    ),
    # --- teardown and detection timing, loss-curve tolerances, the health collector ---
    M(
        "microbatch_grads_rounded_to_bf16",
        "each microbatch's gradient is rounded to bf16 before it is accumulated (not fp32 accumulation)",
        (
            (
                "trainer/train/step.py",
                "jax.tree.map(jnp.add, acc[1], g)",
                "jax.tree.map(lambda a, b: a + b.astype(jnp.bfloat16).astype(a.dtype), acc[1], g)",
            ),
        ),
        ("tests/test_resume.py::test_meshes_microbatches_and_dropout_change_the_curve_only_as_they_should",),
        catch="assert micro < CURVE_RTOL",
    ),
    M(
        "group_teardown_by_sigterm",
        "the launcher tears a broken group's survivors down with SIGTERM (they linger in their broken collective)",
        (
            (
                "trainer/supervise/launcher.py",
                "self._killed |= {i for i, p in enumerate(self.procs) if p.poll() is None}\n"
                "            self.send_signal(signal.SIGKILL)",
                "self._killed |= {i for i, p in enumerate(self.procs) if p.poll() is None}\n"
                "            self.send_signal(signal.SIGTERM)",
            ),
        ),
        ("tests/test_multihost.py::test_kill_and_hang_tear_the_group_down_and_the_run_ends_identical",),
        catch='exits[0]["exits"][1] == [0, -signal.SIGKILL]',
    ),
    M(
        "signal_death_counted_as_a_consequence",
        "a process killed by a signal is taken for one that follows its peers: the group waits out the grace",
        (
            (
                "trainer/supervise/launcher.py",
                "broken = [c for c in causes if c not in PEERS_FOLLOW]",
                "broken = [c for c in causes if c not in PEERS_FOLLOW and c >= 0]",
            ),
        ),
        ("tests/test_multihost.py::test_one_dead_process_takes_the_group_down_at_once",),
        catch="teardown_s < GRACE_S / 2",
    ),
    M(
        "config_exit_peers_follow",
        "every controlled exit (exit 2 and STORAGE too) counts as one the peers make by themselves",
        (
            (
                "trainer/supervise/exit_codes.py",
                "PEERS_FOLLOW = frozenset(code for code, r in POLICY.items() if r.peers_follow)",
                "PEERS_FOLLOW = CHOSEN",
            ),
        ),
        ("tests/test_multihost.py::test_a_config_exit_of_one_process_takes_the_group_down_at_once",),
        catch="teardown_s < GRACE_S / 2 and",
    ),
    M(
        "crash_loop_one_attempt_late",
        "a crash loop is declared one failure after supervisor.crash_loop_restarts",
        (
            (
                "trainer/supervise/exit_codes.py",
                "if tally.same_step >= sc.crash_loop_restarts:",
                "if tally.same_step > sc.crash_loop_restarts:",
            ),
        ),
        ("tests/test_supervisor.py::test_a_crash_loop_gives_up_with_the_step_and_the_last_error",),
        catch="attempts == SupervisorConfig().crash_loop_restarts",
    ),
    M(
        "health_latest_waits_for_a_read",
        "a lock keeps readers off a half-built snapshot but is held while the sources are read: latest() waits",
        (
            (
                "trainer/observe/health.py",
                "self._latest: dict | None = None",
                "self._latest: dict | None = None\n        self._lock = threading.Lock()",
            ),
            (
                "trainer/observe/health.py",
                "        return self._latest\n",
                "        with self._lock:\n            return self._latest\n",
            ),
            (
                "trainer/observe/health.py",
                "        self.sample()\n        while not self._stop.wait(self.every_s):\n            self.sample()",
                "        with self._lock:\n            self.sample()\n"
                "        while not self._stop.wait(self.every_s):\n"
                "            with self._lock:\n                self.sample()",
            ),
        ),
        ("tests/test_dashboard.py::test_health_collector_is_off_the_hot_path_and_works_without_nvml",),
        catch="min(src.during) > 1",
    ),
    M(
        "straggler_named_though_it_keeps_ahead",
        "the straggler watch names the process with the most own time even when it still waits on its device "
        "(a slower host hidden behind the device step costs nothing)",
        (
            (
                "trainer/supervise/straggler.py",
                "if not others or (w.wait[p] > CRITICAL * step and not w.sync[p]):",
                "if not others:",
            ),
        ),
        ("tests/test_straggler.py::test_a_slower_host_that_keeps_ahead_of_its_device_is_no_straggler",),
        catch='"named a process that keeps ahead of its device"',
    ),
    M(
        "straggler_blamed_for_any_slowdown",
        "a busy host is named for a slowdown its own work does not explain (the devices slowed for everyone)",
        (
            (
                "trainer/supervise/straggler.py",
                "if slowdown < self.cfg.factor or excess < EXPLAINS * (step - calm):",
                "if slowdown < self.cfg.factor:",
            ),
        ),
        ("tests/test_straggler.py::test_a_group_slower_for_another_reason_names_no_one",),
        catch='w.observe(g.run(20, [0.01, 0.015]), "a") == []',
    ),
    M(
        "straggler_verdict_on_one_window",
        "one slow window makes a verdict (straggler.windows ignored): a pause is called a straggler",
        (("trainer/supervise/straggler.py", "            if n >= self.cfg.windows:", "            if n >= 1:"),),
        ("tests/test_straggler.py::test_below_the_factor_or_for_one_window_no_verdict",),
        catch='assert w.observe(g.run(20, own), "a") == []',
    ),
    M(
        "straggler_verdict_on_one_window_end_to_end",
        "one slow window makes a verdict (straggler.windows ignored), seen end to end: a one-off pause of one "
        "process for a window's steps names it",
        (("trainer/supervise/straggler.py", "            if n >= self.cfg.windows:", "            if n >= 1:"),),
        ("tests/test_straggler.py::test_a_run_that_pauses_once_saves_evaluates_and_restarts_names_no_one",),
        catch='e["event"] in (E.STRAGGLER, E.ALERT)',
    ),
    M(
        "straggler_calm_takes_the_onset_window",
        "the window a slowdown starts in (half slow, no candidate yet) is taken for calm: the verdict understates it",
        (
            (
                "trainer/supervise/straggler.py",
                "        if self.calm and step > self.cfg.factor",
                "        if False and self.calm and step > self.cfg.factor",
            ),
        ),
        ("tests/test_straggler.py::test_the_window_a_slowdown_starts_in_is_not_taken_for_calm",),
        catch="abs(v.slowdown - 0.152 / 0.102) < 1e-9",
    ),
    M(
        "straggler_host_bound_line_below_a_fast_step",
        "the host-bound line drawn at 0.5% of the step: on fast steps the process the group waits for still "
        "waits 1-2% of it (reading the results it queued), so it is never named",
        (("trainer/supervise/straggler.py", "CRITICAL = 0.1  #", "CRITICAL = 0.005  #"),),
        ("tests/test_straggler.py::test_a_slowed_process_is_named_then_cleared_and_an_ecc_rise_on_it_checkpoints",),
        catch="assert len(verdicts) == 1, verdicts",
    ),
    M(
        "straggler_slowdown_of_the_last_window",
        "the verdict's slowdown is its last window's alone: one stall of a loaded host in those steps inflates it "
        "(a run beside the suite read 7.3x where its slowed steps showed 3.9x)",
        (
            (
                "trainer/supervise/straggler.py",
                "    step = calm + lost / steps\n",
                "    step = v.slowdown * v.calm_s\n",
            ),
        ),
        ("tests/test_straggler.py::test_the_slowdown_is_the_mean_over_every_window_behind_the_verdict",),
        catch="abs(v.slowdown - 0.302 / 0.102) < 1e-9",
    ),
    M(
        "straggler_cleared_by_a_slow_window_no_one_was_named_in",
        "a window with no one named counts toward clearing the verdict though the group is still 3x slow: under "
        "load the verdict clears a window early, before the slowdown is over",
        (
            (
                "trainer/supervise/straggler.py",
                "            elif found or self._eased(w):\n",
                "            else:\n",
            ),
        ),
        ("tests/test_straggler.py::test_a_window_still_slow_with_no_one_named_clears_nothing",),
        catch='[[], [], [], [("straggler", 1)], [], [], [("cleared", 1)]]',
    ),
    M(
        "bucket_cut_short_upload_dropped",
        "a staged step sealed on disk whose upload was cut short (its process lost mid-upload) is dropped, not "
        "uploaded again: the restore falls back to the step before it",
        (
            (
                "trainer/ckpt/tiers.py",
                'plan["upload" if manifest.sealed(self.durable.step_dir(step)) else "drop"]',
                'plan["drop"]',
            ),
        ),
        ("tests/test_bucket.py::test_a_step_whose_upload_was_cut_short_is_uploaded_again_not_dropped",),
        catch="E.CHECKPOINT_RESEALED] == [13]",
    ),
    M(
        "straggler_slowdown_against_its_own_excess",
        "the verdict's slowdown measured against the step without the straggler's excess, not the group's calm "
        "windows: a process sleeping 3x the step reads as a 30x slowdown",
        (
            (
                "trainer/supervise/straggler.py",
                "calm = statistics.median(self.calm) if self.calm else max(step - excess, 1e-3 * step)",
                "calm = max(step - excess, 1e-3 * step)",
            ),
        ),
        ("tests/test_straggler.py::test_a_slowed_process_is_named_then_cleared_and_an_ecc_rise_on_it_checkpoints",),
        catch="0.7 <= ratio <= 1.5",
    ),
    M(
        "drill_heals_at_any_step",
        "the drill calls a fault healed at the restart's first step, even one it had already trained (recompute)",
        (
            (
                "trainer/drill/checks.py",
                'first = next((e for e in steps if e["time"] > since and e["step"] > best), None)',
                'first = next((e for e in steps if e["time"] > since), None)',
            ),
        ),
        ("tests/test_drill.py::test_each_fault_is_matched_to_its_detection_and_the_first_step_past_where_the_run_was",),
        catch='crash["productive_s"] == 12.0',
    ),
    M(
        "drill_spikes_close_enough_to_soften",
        "the drill's schedule puts a spike within runbook.recur_distance of another: the runbook softens the LR",
        (
            (
                "trainer/drill/plan.py",
                "    if row.rewinds and step - drawn.last_rewind <= rb.recur_distance:",
                '    if row.rewinds and kind == "nan" and step - drawn.last_rewind <= rb.recur_distance:',
            ),
        ),
        ("tests/test_drill.py::test_the_schedule_is_seeded_poisson_and_lands_each_kind_where_it_can",),
        catch="b - c > rb.recur_distance",
    ),
    M(
        "restore_phase_at_step_0",
        "the restore phase reports step 0 whatever it reads: a restore-phase fault armed past 0 never fires",
        (
            (
                "trainer/train/loop.py",
                "_enter(w, Phase.RESTORE, _newest_durable(w))",
                "_enter(w, Phase.RESTORE, 0)",
            ),
        ),
        ("tests/test_drill.py::test_startup_and_restore_hangs_wait_for_a_restart_from_their_step",),
        catch='assert [(f["kind"], f["phase"]) for f in fired] == [',
    ),
    M(
        "startup_phase_at_step_0",
        "the start-up phase reports step 0 on every start: a startup-phase fault armed past 0 never fires",
        (("trainer/train/loop.py", "_enter(w, Phase.STARTUP, _newest_durable(w))", "_enter(w, Phase.STARTUP, 0)"),),
        ("tests/test_drill.py::test_startup_and_restore_hangs_wait_for_a_restart_from_their_step",),
        catch='assert [(f["kind"], f["phase"]) for f in fired] == [',
    ),
    M(
        "drill_goodput_forgets_targeted_recompute",
        "the drill's goodput expectation leaves out what faults aimed at the newest checkpoint recomputed",
        (
            (
                "trainer/drill/checks.py",
                'predicted_running = secs["productive"] + recompute + other + paid',
                'predicted_running = secs["productive"] + recompute + paid',
            ),
        ),
        ("tests/test_drill.py::test_goodput_is_compared_with_the_model_on_the_same_measured_costs",),
        catch='gp["predicted"] == pytest.approx(100 / 144)',
    ),
    M(
        "drill_misses_a_fast_tier_only",
        "the drill says nothing when only the fast tier saves periodically (a lost node takes every checkpoint)",
        (("trainer/drill/checks.py", "    elif not durable:", "    elif False:"),),
        ("tests/test_drill.py::test_the_setup_lines_name_what_breaks_and_the_fix",),
        catch='lines[0].startswith("a fast tier only")',
    ),
    M(
        "health_from_process_0_only",
        "only process 0 watches its host's health: an ECC rise on another host is never seen",
        (("trainer/observe/alerts.py", "        return [hardware]", "        return []"),),
        ("tests/test_straggler.py::test_a_slowed_process_is_named_then_cleared_and_an_ecc_rise_on_it_checkpoints",),
        catch="assert health == {0, 1}",
    ),
    M(
        "host_health_only_in_events",
        "processes other than 0 write no TensorBoard: another host's health and alerts are only in the events",
        (
            (
                "trainer/train/worker.py",
                "            enabled=cfg.log.tensorboard and cfg.log.health,",
                "            enabled=False,",
            ),
        ),
        ("tests/test_straggler.py::test_a_slowed_process_is_named_then_cleared_and_an_ecc_rise_on_it_checkpoints",),
        catch="hosts.is_dir() and sorted(p.name for p in hosts.iterdir())",
    ),
    M(
        "straggler_costs_nothing_in_the_ledger",
        "the goodput ledger leaves a straggler's lost step time in productive",
        (("trainer/observe/goodput.py", '    moved = min(slowed, secs["productive"])', "    moved = 0.0"),),
        ("tests/test_status_report.py::test_a_straggler_costs_the_group_its_lost_step_time_and_the_drain_its_restart",),
        catch="assert secs == {",
    ),
    M(
        "drain_keeps_the_node",
        "a drained straggler's node is not marked suspect: the group restarts on it again",
        (
            (
                "trainer/supervise/watch.py",
                '        att.proc.blame_node(v.node, f"straggler: {straggler.describe(v)}")\n',
                "",
            ),
        ),
        ("tests/test_node_loss.py::test_a_straggler_node_is_drained_onto_the_spare_and_the_run_ends_identical",),
        catch='assert [s["nodes"] for s in starts] == [["n1", "n2"], ["n1", "n3"]], starts',
    ),
    M(
        "drill_loses_the_drills_own_node",
        "the drill's node loss may pick a process on the first node, where the drill and the supervisor run",
        (
            (
                "trainer/drill/plan.py",
                "rng.randrange(cfg.launch.processes_per_node, cfg.launch.processes)",
                "rng.randrange(0, cfg.launch.processes)",
            ),
        ),
        ("tests/test_drill.py::test_the_schedule_is_seeded_poisson_and_lands_each_kind_where_it_can",),
        catch='f["process"] in (2, 3) for f in lost',
    ),
    M(
        "drill_loses_more_nodes_than_spares",
        "the drill plans node losses beyond the allocation's spares: the run cannot keep its size",
        (
            (
                "trainer/drill/plan.py",
                '"spares": spares,',
                '"spares": 10**9,',
            ),
        ),
        ("tests/test_drill.py::test_the_schedule_is_seeded_poisson_and_lands_each_kind_where_it_can",),
        catch="assert len(lost) == 2",
    ),
    M(
        "drill_node_loss_seen_as_any_exit",
        "the drill takes any worker exit for a node loss's detection, not the supervisor blaming the node",
        (("trainer/drill/checks.py", 'e["event"] == NODE_SUSPECT,', 'e["event"] == WORKER_EXIT,'),),
        ("tests/test_drill.py::test_a_drill_inside_a_slurm_allocation_loses_a_node_and_passes",),
        catch='node["detected_by"] == E.NODE_SUSPECT',
    ),
    M(
        "corrupt_spares_the_fast_tier",
        "the corrupt fault hits the newest durable checkpoint even where a newer local one is what the restart reads",
        (
            (
                "trainer/faults/injector.py",
                "corrupt.newest(self._run_dir, f.how, local)",
                "corrupt.newest(self._run_dir, f.how)",
            ),
        ),
        ("tests/test_drill.py::test_a_corrupt_fault_hits_the_checkpoint_the_restart_reads_first",),
        catch='fired["hit"].startswith("local:15/state/")',
    ),
    M(
        "full_disk_stops_at_once",
        "the supervisor gives up on a full disk at once, never waiting for room (nor seeing there is some)",
        (
            (
                "trainer/supervise/storage.py",
                "    need, have = room_needed(run_dir), free_bytes(run_dir)\n",
                "    return False\n",
            ),
        ),
        ("tests/test_integrity.py::test_no_room_within_the_wait_stops_the_run_for_a_human",),
        catch="assert time.monotonic() - t0 >= 3",
    ),
    M(
        "disk_full_never_injected",
        "the disk_full fault is recorded but the save it names goes through",
        (("trainer/faults/injector.py", "            storage.fail_next_save(OSError(", "            _ = (OSError("),),
        ("tests/test_drill.py::test_a_disk_full_fault_fails_its_save_and_the_run_restarts_when_there_is_room",),
        catch="assert len(failures) == 1",
    ),
    M(
        "drill_blames_the_setup_for_its_own_disk_full",
        "the drill's setup check takes its own injected disk_full failures for a disk too small",
        (("trainer/drill/checks.py", ' and "(injected" not in e.get("message", "")]', "]"),),
        ("tests/test_drill.py::test_the_setup_lines_name_what_breaks_and_the_fix",),
        catch="assert checks.setup(cfg, injected, crashes, run) == []",
    ),
    M(
        "drill_spikes_beyond_the_runbook_budget",
        "the drill plans more spikes and NaNs than runbook.max_actions: the runbook stops the drilled run (exit 79)",
        (
            (
                "trainer/drill/plan.py",
                '"runbook": cfg.runbook.max_actions}',
                '"runbook": 10**9}',
            ),
        ),
        ("tests/test_drill.py::test_the_schedule_is_seeded_poisson_and_lands_each_kind_where_it_can",),
        catch="assert len(rewinds) == rb.max_actions",
    ),
    M(
        "drill_hangs_every_restart",
        "the drill arms several hangs in the restarts after one failure: the same checkpoint fails three times",
        (
            (
                "trainer/drill/plan.py",
                'if KINDS[p.kind].fires == "restart":\n            return None',
                'if KINDS[p.kind].fires == "restart":\n            continue',
            ),
        ),
        ("tests/test_drill.py::test_the_schedule_is_seeded_poisson_and_lands_each_kind_where_it_can",),
        catch="x in AFTER_RESTART and y in AFTER_RESTART",
    ),
    M(
        "sigterm_after_the_last_step_requeues",
        "a SIGTERM in the last step exits PREEMPTED though the run is done: the job is requeued for nothing",
        (
            (
                "trainer/train/endings.py",
                "    if step < w.cfg.train.steps:  # ended early",
                "    if step < w.cfg.train.steps or flags.stop:  # ended early",
            ),
        ),
        ("tests/test_supervisor.py::test_a_sigterm_in_the_last_step_finishes_the_run_instead_of_asking_for_a_requeue",),
        catch="assert proc.returncode == exit_codes.OK",
    ),
    M(
        "peer_killed_after_a_controlled_exit_blamed",
        "srun kills the peer of a task that left on purpose (a full disk's exit 81): the peer's node is blamed",
        (
            (
                "trainer/supervise/srun_group.py",
                "and not (chosen and c == -signal.SIGKILL)",
                "",
            ),
        ),
        ("tests/test_multihost.py::test_node_blame_names_the_node_that_died_not_its_survivors",),
        catch="assert g.blame() == [] and g.failed_node() is None and g.poll() == exit_codes.STORAGE",
    ),
    M(
        "head_backward_in_fp32",
        "the sliced loss's backward multiplies the fp32 d logits (the head's two backward matmuls run in fp32)",
        (
            (
                "trainer/model/loss.py",
                "dlogits_BCV = nn.with_logical_constraint(dlogits_BCV.astype(dt), LOGITS)",
                "dlogits_BCV = nn.with_logical_constraint(dlogits_BCV, LOGITS)",
            ),
        ),
        ("tests/test_loss.py::test_vocab_matmuls_take_bf16_and_the_logits_are_never_whole",),
        catch='assert (m.program_dtypes or m.operand_dtypes) == ("bf16", "bf16"), m',
    ),
    M(
        "head_grad_from_the_last_slice",
        "the head's gradient keeps only the last slice's share instead of summing every slice's",
        (
            (
                "trainer/model/loss.py",
                "nn.with_logical_constraint(dhead_SDV + d_SDV, per_shard)",
                "nn.with_logical_constraint(0 * dhead_SDV + d_SDV, per_shard)",
            ),
        ),
        ("tests/test_loss.py::test_sliced_head_loss_matches_autodiff_of_the_whole_logits[float32-1e-05-8-0.01]",),
        catch="assert float(jnp.max(jnp.abs(a - b))) <= grad_tol * scale",
    ),
    M(
        "drill_passes_on_one_fault",
        "the drill's thresholds default to one fault of one kind: the 4-minute tiny drill's lone preemption passes",
        (("trainer/drill/plan.py", "MIN_FAULTS, MIN_KINDS = 8, 4", "MIN_FAULTS, MIN_KINDS = 1, 1"),),
        ("tests/test_drill.py::test_a_drill_too_short_to_show_anything_is_refused_grown_or_failed",),
        catch='"the plan held 1 fault(s) of 1 kind(s) (preempt): a drill of fewer than 8 faults of 4"',
    ),
    M(
        "skip_list_off_by_one",
        "a step whose batch index equals a skipped batch reads it anyway (the cursor passes skips only below it)",
        (("trainer/train/data.py", "        if s <= b:\n            b += 1", "        if s < b:\n            b += 1"),),
        ("tests/test_data.py::test_skips_advance_the_cursor_past_the_listed_batches",),
        catch="assert [batch_index(k, [2, 3]) for k in range(5)] == [0, 1, 4, 5, 6]",
    ),
    M(
        "eval_rows_strided_over_processes",
        "each process takes every P-th eval row instead of its contiguous block (unlike the training rows)",
        (
            (
                "trainer/train/data.py",
                "rows = picks.reshape(batches, global_batch)[:, process * per : (process + 1) * per]",
                "rows = picks.reshape(batches, global_batch)[:, process::processes]",
            ),
        ),
        ("tests/test_data.py::test_eval_windows_are_fixed_spread_over_the_split_and_sharded_like_training",),
        catch="assert (np.concatenate(halves, axis=1) == whole).all()",
    ),
    M(
        "buddy_on_the_same_node",
        "uneven nodes pair a process with one on its own node: its fast-tier copy dies with it",
        (
            (
                "trainer/ckpt/buddy.py",
                "    if any(nodes[i] == nodes[to[i]] for i in range(len(nodes))):\n        return None\n",
                "",
            ),
        ),
        ("tests/test_buddy.py::test_every_copy_goes_to_another_node_at_the_same_local_rank",),
        catch='assert buddy.pair(["a", "a", "a", "b"]) is None',
    ),
    M(
        "replica_fingerprint_casts_bf16_values",
        "a bfloat16 param is fingerprinted by its values cast to integers, not its bits: a low flipped bit is unseen",
        (
            (
                "trainer/train/replicas.py",
                "else jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)",
                "else x.astype(jnp.uint32)",
            ),
        ),
        ("tests/test_replicas.py::test_the_replica_check_names_the_one_copy_that_differs_float32_and_bfloat16",),
        catch="a bfloat16 copy with a flipped bit passed the check",
    ),
    M(
        "replica_mismatch_blames_every_replica",
        "a mismatch names every data replica of the shard, not the odd one out (the runbook blames every node)",
        (
            (
                "trainer/train/replicas.py",
                '"replicas": sorted({self.coords[d]["data"] for d in odd}),',
                '"replicas": sorted({self.coords[d]["data"] for d in devs}),',
            ),
        ),
        ("tests/test_replicas.py::test_the_replica_check_names_the_one_copy_that_differs_float32_and_bfloat16",),
        catch='assert w["replicas"] == [data_of[out["w_flipped"]["device"]]], w',
    ),
    M(
        "init_ignores_the_seed",
        "the state is initialised from a fixed key: run.seed changes nothing",
        (("trainer/train/state.py", "    key = jax.random.key(seed)\n", "    key = jax.random.key(0)\n"),),
        ("tests/test_state.py::test_a_fresh_state_is_a_function_of_the_seed_and_matches_its_restore_target",),
        catch='state.params_sha256(a["params"]) != state.params_sha256(other["params"])',
    ),
    M(
        "weight_decay_on_positions",
        "weight decay reaches the positional table too (every param with an embed axis is decayed)",
        (("trainer/train/optim.py", 'NO_DECAY_AXES = frozenset({"seq"})', "NO_DECAY_AXES = frozenset()"),),
        ("tests/test_model.py::test_weight_decay_reaches_the_same_matrices_scanned_or_unrolled[True-True]",),
        catch='assert decayed == (DECAYED if tie else DECAYED | {"lm_head"}), sorted(decayed)',
    ),
    M(
        "sigterm_saves_a_held_state",
        "a SIGTERM while a spike is probed saves the frozen spike state (a stop overrides the hold)",
        (
            (
                "trainer/ckpt/save_policy.py",
                "        if hold:\n            return None\n",
                "        if hold and not stop:\n            return None\n",
            ),
        ),
        ("tests/test_save_policy.py::test_which_reason_wins_and_a_hold_never_saves",),
        catch="assert decide(p, 10, stop=True, hold=True) is None",
    ),
    M(
        "guard_silence_counted_from_its_start",
        "the guard measures the lease's silence from its own start, not from the last renewal: it requeues a "
        "healthy job",
        (
            (
                "trainer/supervise/guard.py",
                '            last, since = lease.get("beat"), time.monotonic()',
                '            last = lease.get("beat")',
            ),
        ),
        ("tests/test_guard.py::test_the_guard_waits_out_a_renewed_lease_and_requeues_once_it_stops",),
        catch="assert took >= RENEWED_S + STALE_S - 0.15",
    ),
    M(
        "grad_norm_sustain_off_by_one",
        "a grad-norm spike must stay high one step longer than runbook.grad_sustain says",
        (
            (
                "trainer/observe/spikes.py",
                "if self._grad_high >= self.cfg.grad_sustain:",
                "if self._grad_high > self.cfg.grad_sustain:",
            ),
        ),
        ("tests/test_runbook.py::test_a_lone_grad_norm_blip_is_not_a_spike_but_a_sustained_rise_is",),
        catch='assert [(s, a["do"]) for s, a in actions] == [(71, "hold"), (72, "spike")]',
    ),
    M(
        "json_writes_nan_tokens",
        "the run dir's JSON writer drops the strict encoding: a NaN loss is written as the non-standard NaN",
        (
            (
                "trainer/store/rundir.py",
                "return json.dumps(_finite(obj), indent=indent, allow_nan=False)",
                "return json.dumps(obj, indent=indent)",
            ),
        ),
        ("tests/test_rundir.py::test_json_is_strict_nonfinite_floats_are_null_and_a_torn_file_reads_as_none",),
        catch='assert strict == {"loss": None, "v": [1.5, None, None], "n": {"x": None, "k": 3}}, text',
    ),
    M(
        "crash_loses_the_whole_interval",
        "the survival model charges a crash the whole checkpoint interval, not half of it on average",
        (
            (
                "trainer/survival/model.py",
                "lost_h, checkpoints = min(tau_h, run_h) / 2.0, run_h / tau_h",
                "lost_h, checkpoints = min(tau_h, run_h), run_h / tau_h",
            ),
        ),
        ("tests/test_survival.py::test_lesson_numbers",),
        catch='assert m["lost_per_crash_gpu_hours"] == pytest.approx(512.0)',
    ),
    M(
        "stop_without_requeue",
        "told to stop (SIGTERM to the supervisor), a crashed or spiking attempt is restarted, not requeued",
        (
            (
                "trainer/supervise/exit_codes.py",
                "if rule.then == REQUEUE or e.stopping:",
                "if rule.then == REQUEUE:",
            ),
        ),
        ("tests/test_exit_policy.py::test_what_the_supervisor_asked_for_or_was_told_overrides_the_row",),
        catch="assert (d.do, d.code, d.tally) == (ec.REQUEUE, ec.PREEMPTED, ec.Tally()), (code, d)",
    ),
    M(
        "crash_loop_counts_every_step",
        "the crash-loop counter never starts over: failures at different steps add up to a crash loop",
        (
            (
                "trainer/supervise/exit_codes.py",
                "same = tally.same_step + 1 if e.step == tally.fail_step else 1",
                "same = tally.same_step + 1",
            ),
        ),
        (
            "tests/test_exit_policy.py::test_the_same_step_failing_crash_loop_restarts_times_gives_up_with_backoff_before",
        ),
        catch="assert [d.do for d in ds] == [ec.RESTART] * 4 and [d.backoff_s for d in ds] == [0.0, 1.0, 0.0, 1.0]",
    ),
    M(
        "hang_rereads_the_heartbeats",
        "a hang's blame reads every heartbeat again instead of the poll's snapshot",
        (
            (
                "trainer/supervise/watch.py",
                "hang.hung_on(s.beats, snap.beats, snap.pulses)",
                "hang.hung_on(s.beats, snapshot(sup.run_dir, att).beats, snap.pulses)",
            ),
        ),
        ("tests/test_exit_policy.py::test_a_hang_reads_each_heartbeat_once_in_its_poll_and_once_after_the_exit",),
        catch='assert sorted(reads) == ["worker-0.json", "worker-1.json"], reads',
    ),
    M(
        "progress_every_step_in_a_log",
        "off a terminal the progress line is written every step (a 3-week run writes millions of lines)",
        (
            (
                "trainer/observe/progress.py",
                "elif self._each_step or not self._written or step % self._every == 0 or step >= self._total:",
                "elif True:",
            ),
        ),
        ("tests/test_progress.py::test_off_a_terminal_a_line_every_log_interval_and_the_first_and_last",),
        catch='assert "\\r" not in text and text.count("\\n") == 31, text',
    ),
    M(
        "progress_drops_the_last_step",
        "off a terminal an attempt that stops between two log intervals never writes its last step",
        (
            (
                "trainer/observe/progress.py",
                "elif self._unwritten is not None:",
                "elif False:",
            ),
        ),
        ("tests/test_progress.py::test_off_a_terminal_a_line_every_log_interval_and_the_first_and_last",),
        catch="assert _steps(_drive(io.StringIO(), range(32, 46))) == [32, 40, 45]",
    ),
    M(
        "run_dir_lock_shared",
        "the run dir's lock is a shared one: a second supervisor trains on a run dir another one drives",
        (
            (
                "trainer/store/rundir.py",
                "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)",
                "fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)",
            ),
        ),
        ("tests/test_supervisor.py::test_a_second_supervisor_on_the_same_run_dir_is_refused",),
        catch='assert second.returncode == exit_codes.LOCKED and "in use by another supervisor" in second.stderr',
    ),
    M(
        "spike_latest_wins",
        "the spike detector goes on reporting after its spike: a group still agreeing to exit takes the latest "
        "report and skips the batches after a NaN instead of the one that caused it",
        (
            (
                "trainer/observe/spikes.py",
                "        if self._reported:\n",
                "        if False:\n",
            ),
        ),
        ("tests/test_runbook.py::test_the_loop_keeps_the_first_spike_while_the_group_agrees_to_exit",),
        catch='assert (flags.spike["step"], flags.spike["began"], flags.spike["batches"]) == (5, 5, [4])',
    ),
    M(
        "spike_latest_wins_two_processes",
        "as spike_latest_wins, seen end to end with 2 processes",
        (
            (
                "trainer/observe/spikes.py",
                "        if self._reported:\n",
                "        if False:\n",
            ),
        ),
        (
            "tests/test_multihost.py::test_two_processes_catch_a_flipped_replica_across_them_and_run_the_runbook_on_a_nan",
        ),
        catch="assert skips == [[22]]",
    ),
    M(
        "export_metadata_unsorted",
        "the export leaves the safetensors metadata in the order safetensors wrote it (another in each process)",
        (("trainer/tools/export.py", "        _sort_metadata(tmp / MODEL)\n", ""),),
        ("tests/test_export.py::test_exports_of_one_checkpoint_are_the_same_bytes",),
        catch="assert (tmp_path / str(i) / f).read_bytes() == (first / f).read_bytes(), f",
    ),
    M(
        "storage_wait_ignored",
        "when no room comes within supervisor.storage_wait_minutes the supervisor restarts into the full disk "
        "instead of stopping for a human (exit 81)",
        (
            (
                "trainer/supervise/after_exit.py",
                "if not storage.wait_for_room(sup.run_dir, wait, sup.events.write, step=step, stop=sup.stopping):",
                "if not storage.wait_for_room(sup.run_dir, wait, sup.events.write, step=step, stop=sup.stopping) "
                "and False:",
            ),
        ),
        ("tests/test_integrity.py::test_two_processes_on_a_disk_that_stays_full_stop_with_exit_81_and_its_line",),
        catch="assert code == exit_codes.STORAGE, text[-3000:]",
    ),
    M(
        "frozen_without_a_live_peer",
        "the supervisor calls a process frozen whenever its pulse is old, even when every pulse is (a stalled "
        "shared disk, a suspended machine): a false verdict and a restart for nothing",
        (("trainer/supervise/hang.py", "if stale and fresh else None", "if stale else None"),),
        ("tests/test_downtime.py::test_a_frozen_process_is_named_only_while_a_peer_is_alive",),
        catch="assert hang.pulses([pulse(stale), pulse(stale + 1)], NOW).frozen is None",
    ),
    M(
        "frozen_when_leaving",
        "a process that left on purpose (done, preempted) is called frozen once its pulse stops",
        (
            (
                "trainer/supervise/hang.py",
                "if p is not None and not p.ending}",
                "if p is not None}",
            ),
        ),
        ("tests/test_downtime.py::test_a_frozen_process_is_named_only_while_a_peer_is_alive",),
        catch="assert hang.pulses([pulse(fresh), pulse(stale, ending=True)], NOW).frozen is None",
    ),
    M(
        "frozen_only_by_timeout",
        "a frozen process is left to the step timeout (its peers wait silently in a collective): the group waits "
        "supervisor.step_timeout_s, not seconds",
        (
            (
                "trainer/supervise/watch.py",
                "if check_hang(sup, att, snap) or check_frozen(sup, att, snap):",
                "if check_hang(sup, att, snap):",
            ),
        ),
        ("tests/test_multihost.py::test_kill_and_hang_tear_the_group_down_and_the_run_ends_identical",),
        catch='assert frozen["phase"] == "frozen" and frozen["process"] == 1 and frozen["step"] >= 25, frozen',
    ),
    M(
        "downtime_from_the_notice",
        "a restart's downtime counts from when the supervisor knew, not from the failure (the time a frozen "
        "process went unnoticed disappears from the accounting)",
        (
            (
                "trainer/supervise/after_exit.py",
                "failed = min(att.failed, noticed) if att.failed else "
                "downtime.failed_at(ps, att.proc.cause_t, noticed)",
                "failed = noticed",
            ),
        ),
        ("tests/test_multihost.py::test_kill_and_hang_tear_the_group_down_and_the_run_ends_identical",),
        catch='assert down[2]["parts_s"]["noticed"] > PULSE_STALE_S - PULSE_S, down[2]',
    ),
    M(
        "downtime_launch_from_python",
        "a restarted process counts its start from when Python got going, not from the kernel's record of its "
        "start (the interpreter's start-up vanishes from the accounting)",
        (
            (
                "trainer/observe/downtime.py",
                '        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))',
                "        return time.time()",
            ),
        ),
        ("tests/test_downtime.py::test_a_process_knows_when_it_started",),
        catch="assert late - 0.02 < since_start < time.time() - t0 + 0.02, (since_start, time.time() - t0)",
    ),
    M(
        "standby_never_used",
        "the standby processes started ahead are never handed the next attempt: every restart starts cold "
        "(interpreter and imports, ~1 s)",
        (
            (
                "trainer/supervise/launcher.py",
                "standby.go(envs) if standby is not None and standby.ready_for(processes) else []",
                "standby.go(envs) if standby is not None and standby.ready_for(processes) and False else []",
            ),
        ),
        ("tests/test_supervisor.py::test_restart_uses_the_compilation_cache",),
        catch='starts[1].get("standby") in ("ready", "starting")',
    ),
    M(
        "sealed_listing_races_retention",
        "listing a step's manifests fails when retention deletes the step meanwhile: the save dies of it",
        (
            (
                "trainer/store/manifest.py",
                "    except OSError:  # the step dir went while it was listed",
                "    except ValueError:  # the step dir went while it was listed",
            ),
        ),
        ("tests/test_integrity.py::test_a_step_deleted_while_its_seals_are_listed_is_unsealed_not_a_crash",),
        catch='f"a step that went is no sealed step, not {listed!r}"',
    ),
    M(
        "cpu_processes_recompile_at_every_start",
        "on XLA:CPU only process 0 writes its executables to the compilation cache (jax's rule): every other "
        "process of a group compiles its step again at every start",
        (
            (
                "trainer/parallel/distributed.py",
                "if global_state.process_id == 0 or host_callbacks:",
                "if True:",
            ),
        ),
        ("tests/test_multihost.py::test_kill_and_hang_tear_the_group_down_and_the_run_ends_identical",),
        catch="assert hits == [4, 4] and \"MISS for 'jit_train_step'\" not in log, hits",
    ),
    M(
        "schedule_baked_into_the_step",
        "a constant that follows train.steps is compiled into the train step: a run extended on resume (or any "
        "run of another length) compiles its step again instead of loading it from the cache",
        (
            (
                "trainer/train/step.py",
                "microbatches=microbatches, z_loss=cfg.train.z_loss)",
                "microbatches=microbatches, z_loss=cfg.train.z_loss + 1e-12 * cfg.train.steps)",
            ),
        ),
        ("tests/test_config.py::test_harmless_change_resumes_and_is_logged",),
        catch="assert hit in longer.stderr",
    ),
    M(
        "bucket_restore_reads_only_the_staging_copy",
        "with the durable tier in a bucket, a restore reads the staging directory and never downloads: a node "
        "without the staging copies (or a staging copy gone) cannot resume from the bucket",
        (
            (
                "trainer/ckpt/tiers.py",
                "_unreadable(lambda: self.durable.fetch(step))",
                "_unreadable(lambda: None)",
            ),
        ),
        (
            "tests/test_bucket.py::test_a_run_whose_durable_tier_is_a_bucket_resumes_from_it_bitwise_and_falls_back_past_a_flipped_byte",
        ),
        catch="assert rejected == [(13,",
    ),
    M(
        "bucket_unsealed_staging_kept",
        "a staged step sealed nowhere (its process died before its checksums) stays in the staging directory: the "
        "resumed run cannot save that step again (Orbax: the step exists) and crash-loops",
        (
            (
                "trainer/ckpt/tiers.py",
                "                shutil.rmtree(self.durable.step_dir(step), ignore_errors=True)\n",
                "                pass\n",
            ),
        ),
        ("tests/test_bucket.py::test_a_step_whose_upload_was_cut_short_is_uploaded_again_not_dropped",),
        catch="assert proc.returncode == 0",
    ),
    M(
        "bucket_download_takes_only_the_first_share",
        "every process of a restore downloads process 0's manifest and files: the shards the other processes "
        "wrote never reach the staging directory, and a multi-process restore from the bucket fails",
        (("trainer/store/bucket.py", "% share[1] == share[0]]", "% share[1] == 0]"),),
        ("tests/test_node_loss.py::test_two_nodes_lost_in_turn_heal_from_the_peer_copy_then_from_durable",),
        catch='assert (restored[1].get("tier"), restored[1].get("step")) == ("durable", 10)',
    ),
    M(
        "bucket_not_checked_before_writing",
        "a missing bucket is not looked for at start: the run dir is created and the run fails later, with a traceback",
        (("trainer/__main__.py", "if why := bucket.Bucket(cfg.checkpoint.durable_dir).check():", "if why := None:"),),
        ("tests/test_bucket.py::test_a_missing_bucket_is_one_line_exit_2_and_nothing_written",),
        catch="assert p.returncode == 2 and len(lines) == 1",
    ),
    M(
        "bucket_keys_trusted_to_the_server",
        "a step's deletion takes the keys the server lists for the step's range without filtering them: a server "
        "that ignores the range (the GCS emulator) loses every checkpoint at the first retention",
        (
            (
                "trainer/store/bucket.py",
                "[self.kv.write(k, None) for k in self._list(prefix)]",
                "[self.kv.write(k, None) for k in self.kv.list(_range(prefix)).result()]",
            ),
        ),
        ("tests/test_bucket.py::test_a_gcs_bucket_holds_the_durable_tier_and_a_resume_with_no_staged_copy_reads_it",),
        catch="assert sorted({int(k.decode().split",
    ),
    M(
        "bucket_never_pruned",
        "retention applies to the staging directory only: the bucket keeps every checkpoint ever saved",
        (
            (
                "trainer/ckpt/checkpoint.py",
                "        listing = self.bucket.steps()\n        sealed =",
                "        return\n        sealed =",
            ),
        ),
        (
            "tests/test_bucket.py::test_a_run_whose_durable_tier_is_a_bucket_resumes_from_it_bitwise_and_falls_back_past_a_flipped_byte",
        ),
        catch="assert final == sorted(",
    ),
    M(
        "durable_dir_ignored_by_the_worker",
        "the worker's tiers save into RUN_DIR/checkpoints whatever checkpoint.durable_dir says",
        (
            (
                "trainer/ckpt/tiers.py",
                "checkpoint_files.durable_dir(self.run_dir, cfg.durable_dir),\n            cfg,",
                "checkpoint_files.durable_dir(self.run_dir, ''),\n            cfg,",
            ),
        ),
        ("tests/test_checkpoint.py::test_a_durable_dir_elsewhere_holds_the_run_and_every_reader_finds_it",),
        catch='assert sorted(p.name for p in durable.glob("*")) == ["10", "13"]',
    ),
    M(
        "rejected_moved_to_the_run_dir",
        "a rejected durable checkpoint is moved under the run dir, off the durable tier's file system",
        (
            (
                "trainer/store/ckpt_files.py",
                'return Path(run_dir) / name if default else durable.parent / f"{durable.name}-{name}"',
                "return Path(run_dir) / name",
            ),
        ),
        ("tests/test_checkpoint.py::test_a_durable_dir_elsewhere_holds_the_run_and_every_reader_finds_it",),
        catch='assert [p.name.split("-")[0] for p in (scratch / "ckpts-rejected_checkpoints").glob("*")] == ["13"]',
    ),
    M(
        "durable_dir_change_not_refused",
        "a resume naming another checkpoint.durable_dir starts over there instead of being refused",
        (("trainer/train/worker.py", "    check_durable_dir(run_dir, cfg.checkpoint.durable_dir)\n", ""),),
        ("tests/test_checkpoint.py::test_a_durable_dir_elsewhere_holds_the_run_and_every_reader_finds_it",),
        catch="assert moved.returncode == 2",
    ),
    M(
        "summary_keeps_every_old_key",
        "summary.json's update carries every old key over, whatever the writer keeps (a fresh worker's summary or a"
        " rebuild keeps a stale ledger)",
        (("trainer/store/summary.py", "keep = None if keep is None else set(keep)", "keep = None"),),
        (
            "tests/test_rundir.py::"
            "test_summary_json_merges_in_place_starts_afresh_or_keeps_named_keys_and_refuses_unknown_ones",
        ),
        catch='summary.read(tmp_path) == {"data_fingerprint": "fp", "final_step": 12, "restarts": 2}',
    ),
    M(
        "restore_reads_a_held_copy_over_its_own",
        "a local restore reads a process's shards from a copy a peer holds even when the process has its own",
        (
            (
                "trainer/ckpt/holdings.py",
                "key=lambda pc: (pc[0] != t, pc[1].item != STATE, pc[0])",
                "key=lambda pc: (pc[0] == t, pc[1].item != STATE, pc[0])",
            ),
        ),
        ("tests/test_tiers.py::test_a_local_step_is_a_candidate_only_when_every_process_has_a_copy_somewhere",),
        catch="found[12, LOCAL] == Candidate(12, LOCAL,",
    ),
]
