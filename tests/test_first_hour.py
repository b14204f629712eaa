"""A newcomer's first hour, with real processes and real files: a finished run re-run changes no byte, every
outcome is one true line, bad input is one line with exit 2 and writes nothing, damaged files we wrote are
recovered or reported, the JSON we write is strict, and the plots show only what happened."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import MICRO, ROOT, TINY, child_env, events, run_trainer, sets, snapshot, summary, trainer_cmd

from trainer.__main__ import SUBCOMMANDS
from trainer.observe import goodput, report, runview, status
from trainer.store import event_names as E

DONE = ["train.steps=12", "checkpoint.every_steps=6", "log.report=true"]
NOBODY = 65534


def _cli(*args: str, cwd: Path = ROOT, user: int | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainer", *args]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    env = dict(child_env(), PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def _one_error_line(proc: subprocess.CompletedProcess, message: str) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr[-2000:]
    return lines[0]


def _strict(text: str):
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def done(tmp_path_factory) -> tuple[Path, str]:
    """A finished supervised micro run (data cache of its own, progress line on) and what it printed."""
    run = tmp_path_factory.mktemp("done") / "run"
    proc = run_trainer(run, *DONE, "log.progress=true", f"data.cache_dir={run.parent / 'cache'}")
    return run, proc.stderr


def _copy(done_run: Path, dest: Path) -> Path:
    shutil.copytree(done_run, dest, symlinks=True)
    return dest


@pytest.mark.slow
def test_a_finished_run_rerun_says_so_and_changes_no_byte(done, tmp_path):
    run, first = done
    lines = [ln for ln in first.splitlines() if ln.strip()]
    assert lines[0].startswith("fresh start: 12 steps of a ") and str(run) in lines[0], first[-2000:]
    complete = f"run complete at step 12: {run}/summary.json (final loss "
    assert lines[-1].startswith(complete) and f"tensorboard --logdir {run}/tb" in lines[-1], first[-2000:]
    assert f"; report {run}/report/report.md;" in lines[-1], first[-2000:]
    # Its stderr is a pipe, not a terminal: the progress line every log.every_steps (5), the first and the last.
    shown = [int(re.search(r" step (\d+)/12 ", ln)[1]) for ln in lines if "tok/s  ETA" in ln]
    assert shown == [1, 5, 10, 12], first[-2000:]
    assert not (run / "stacks").exists()  # no empty stack file left by the worker start
    before = snapshot(run)
    cache = f"data.cache_dir={run.parent / 'cache'}"
    for worker in (False, True):
        proc = subprocess.run(
            trainer_cmd(run, *DONE, cache, worker=worker),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env=child_env(),
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stderr.splitlines() == [lines[-1]], proc.stderr  # the same one line, and nothing else
        assert snapshot(run) == before, f"re-run (worker={worker}) changed the run dir"
    # A run whose train.steps was raised since is not finished: it resumes from its final checkpoint.
    more = _copy(run, tmp_path / "more")
    # As if the first session had ended an hour ago: that hour between invocations is no one's time.
    recs = [json.loads(x) for x in (more / "events.jsonl").read_text().splitlines()]
    (more / "events.jsonl").write_text("".join(json.dumps(dict(r, time=r["time"] - 3600)) + "\n" for r in recs))
    meta = next((run.parent / "cache").rglob("meta.json"))
    meta.write_text("{torn")  # a damaged data-cache entry of ours: tokenized again, not a traceback
    t0 = time.time()
    proc = run_trainer(more, "train.steps=16", "checkpoint.every_steps=6", cache)
    assert f"resumed from step 12 of checkpoint {more}/checkpoints/12; training to step 16" in proc.stderr
    assert summary(more)["final_step"] == 16 and json.loads(meta.read_text())["fingerprint"]
    assert summary(more)["data_fingerprint"] == summary(run)["data_fingerprint"]
    assert summary(more)["wall_s"] < summary(run)["wall_s"] + time.time() - t0 + 1, summary(more)


def test_the_cli_lists_commands_suggests_and_never_trains_by_accident(tmp_path):
    helped = _cli("--help")
    assert helped.returncode == 0
    commands = helped.stdout.split("\ncommands:\n", 1)[1].split("\n\n")[0].splitlines()
    names = ["--config", *SUBCOMMANDS]  # every subcommand the CLI dispatches, none forgotten in the help
    assert [ln.split()[0] for ln in commands] == names and len(names) >= 7, commands
    assert all(len(ln.split()) > 3 for ln in commands), commands  # each with its one line
    usage = helped.stdout.split("\n\n", 1)[0]  # and the usage line names every one of them
    assert usage.startswith("usage: python -m trainer --config FILE"), usage
    assert re.search(r"python -m trainer \{([\w,]+)\} \.\.\.", usage)[1].split(",") == list(SUBCOMMANDS), usage
    _one_error_line(_cli("staus", "runs/x"), "unknown command 'staus'; did you mean 'status'?")
    _one_error_line(_cli("--confg", TINY), "did you mean --config?")
    bare = _cli(cwd=tmp_path)
    assert bare.returncode == 2 and bare.stderr.startswith("usage: python -m trainer --config FILE")
    assert "status" in bare.stderr and list(tmp_path.iterdir()) == []  # no runs/default


def test_run_deterministic_adds_its_flag_to_xla_flags(monkeypatch):
    """README: run.deterministic sets --xla_gpu_deterministic_ops=true in XLA_FLAGS (configure_devices runs
    before the worker imports jax), after the flags already there, once; off, XLA_FLAGS is left as it was."""
    from trainer.__main__ import configure_devices
    from trainer.config import load_config

    on, off = (load_config(None, [f"run.deterministic={v}"]) for v in ("true", "false"))
    assert on.mesh.cpu_devices == 0  # no fake devices: configure_devices only edits the environment here
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_hlo_as_text")
    configure_devices(off)
    assert os.environ["XLA_FLAGS"] == "--xla_dump_hlo_as_text"
    configure_devices(on)
    configure_devices(on)  # a worker restarted in the same environment
    assert os.environ["XLA_FLAGS"] == "--xla_dump_hlo_as_text --xla_gpu_deterministic_ops=true"


def test_gpu_settings_are_set_in_one_place_after_the_users_flags(monkeypatch):
    """Issue 47: run.xla_latency_hiding and run.gpu_mem_fraction set XLA's latency-hiding scheduler flag and
    XLA_PYTHON_CLIENT_MEM_FRACTION (trainer.xla_env, before jax starts), after the user's flags, once; at
    their defaults they set nothing (XLA's and jax's defaults, or what the user set, hold). No other module of
    the trainer names a GPU flag or jax's client variables."""
    from trainer.__main__ import configure_devices
    from trainer.config import load_config

    mem = "XLA_PYTHON_CLIENT_MEM_FRACTION"
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_hlo_as_text")
    monkeypatch.setenv(mem, "0.5")
    configure_devices(load_config(None, []))
    assert os.environ["XLA_FLAGS"] == "--xla_dump_hlo_as_text" and os.environ[mem] == "0.5"
    on = load_config(None, ["run.xla_latency_hiding=true", "run.gpu_mem_fraction=0.92", "run.deterministic=true"])
    configure_devices(on)
    configure_devices(on)  # a worker restarted in the same environment
    assert os.environ["XLA_FLAGS"] == (
        "--xla_dump_hlo_as_text --xla_gpu_deterministic_ops=true --xla_gpu_enable_latency_hiding_scheduler=true"
    )
    assert os.environ[mem] == "0.92"
    for path in sorted((ROOT / "trainer").rglob("*.py")):  # no XLA flag spelled, no XLA variable set elsewhere
        if path.name != "xla_env.py":
            text = path.read_text()
            assert "--xla_" not in text and not re.search(r"environ\[[^\]]*XLA[^\]]*\] =", text), path


@pytest.mark.slow  # its fixture trains (done)
def test_a_run_records_its_attention_device_and_xla_flags(done):
    """Issue 47: every attempt's `compiled` event says which attention implementation its step runs
    (model.attention resolved for the backend), on which device and platform, under which XLA flags; the
    checkpoint's metadata keeps the same; `status` (and so the report) shows it."""
    from trainer.ckpt import tiers
    from trainer.config import load_config

    run = done[0]
    (c,) = [e for e in events(run) if e["event"] == E.COMPILED]
    want = {"attention": "xla", "platform": "cpu", "device_kind": "cpu", "xla_flags": os.environ["XLA_FLAGS"]}
    assert {k: c.get(k) for k in want} == want and c["gpu_mem_fraction"] == "", c  # the suite's flags, inherited
    meta = tiers.saved_meta(run, load_config(None, []).checkpoint).record
    assert {k: meta.get(k) for k in want} == want, meta
    line = next(ln for ln in status.render(runview.load(run)).splitlines() if ln.startswith("device "))
    assert line == f"device    cpu (cpu)   attention xla   XLA_FLAGS {os.environ['XLA_FLAGS']}", line


@pytest.mark.slow  # its fixture trains (done)
def test_mfu_counts_attentions_causal_half_and_keeps_the_whole_beside_it(done):
    """Issue 47: a step's `mfu` counts attention's causal half (6 x layers x D x L FLOPs a token, as llm.c and
    MaxText count); `mfu_full_attn` beside it, the figure logged before, the whole L x L (nanoGPT's and
    PaLM's): at the step's own tokens/s they differ by exactly that half over the peak."""
    peak = 2.5e10 * 8  # tiny.yaml's nominal log.peak_flops, per device, x its 8 fake devices
    half = 6 * 2 * 64 * 64  # MICRO: 2 layers, d_model 64, seq_len 64
    steps = [e for e in events(done[0]) if e["event"] == E.STEP]
    assert len(steps) == 12
    for e in steps:
        assert 0 < e["mfu"] < e["mfu_full_attn"], e
        assert (e["mfu_full_attn"] - e["mfu"]) * peak / e["tokens_per_s"] == pytest.approx(half, rel=1e-9), e


def _bad_inputs(tmp: Path, run: Path) -> list[tuple[list[str], str]]:
    (tmp / "binary.yaml").write_bytes(bytes(range(256)))
    (tmp / "latin1.yaml").write_bytes("run:\n  dir: café\n".encode("latin-1"))
    (tmp / "tab.yaml").write_text("train:\n\tsteps: 5\n")
    (tmp / "a_file").write_text("not a directory")
    (tmp / "short.txt").write_text("too short for one window")
    cfg = lambda name: ["--config", str(tmp / name), *sets(f"run.dir={run}")]  # noqa: E731
    tiny = lambda *o: trainer_cmd(run, *DONE, *o)[3:]  # noqa: E731
    return [
        (cfg("binary.yaml"), f"{tmp}/binary.yaml is not a UTF-8 text file (byte 0x80 at offset 128)"),
        (cfg("latin1.yaml"), f"{tmp}/latin1.yaml is not a UTF-8 text file (byte 0xe9 at offset 15)"),
        (["--config", str(tmp), *sets(f"run.dir={run}")], f"--config {tmp} is a directory; pass a YAML file"),
        (
            cfg("tab.yaml"),
            "not valid YAML (line 2, column 1: found character '\\t' that cannot start any token; indent with spaces",
        ),
        (tiny("faults=[{kind: crash"), "--set faults=[{kind: crash: the value is not valid YAML"),
        (trainer_cmd(tmp / "a_file", *DONE)[3:], f"run.dir {tmp}/a_file is an existing file, not a directory"),
        (trainer_cmd(tmp / "a_file" / "run", *DONE)[3:], f"{tmp}/a_file is a file, not a directory"),
    ]


@pytest.mark.slow
def test_bad_input_is_one_line_exit_2_and_writes_nothing(done, tmp_path):
    run = _copy(done[0], tmp_path / "run")
    before = snapshot(run)
    for args, message in _bad_inputs(tmp_path, run):
        _one_error_line(_cli(*args), message)
        assert snapshot(run) == before, f"{args} changed the run dir"
    # A corpus shorter than one window: refused before a run dir or a data-cache entry exists.
    new, cache = tmp_path / "new", tmp_path / "cache"
    for worker in (False, True):
        args = trainer_cmd(new, f"data.path={tmp_path}/short.txt", f"data.cache_dir={cache}", worker=worker)[3:]
        _one_error_line(_cli(*args), f"{tmp_path}/short.txt: 25 tokens, shorter than one training window of 65")
        assert not new.exists() and not cache.exists()
    # runbook.json is ours and decides the data: damaged, it is refused by name, never guessed at.
    (run / "runbook.json").write_text('{"skips": [3, "x"]}')
    before = snapshot(run)
    for worker in (False, True):
        _one_error_line(
            _cli(*trainer_cmd(run, *DONE, "train.steps=14", worker=worker)[3:]),
            f"{run}/runbook.json is damaged (not the runbook's JSON object)",
        )
        assert snapshot(run) == before


@pytest.mark.slow
def test_a_read_only_run_dir_or_parent_is_one_line_as_a_non_root_user(done):
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        base.chmod(0o755)  # reachable by the unprivileged user; the run dir and the parent below are not writable
        run = _copy(done[0], base / "run")
        for p in [run, *run.rglob("*")]:
            os.chown(p, NOBODY, NOBODY, follow_symlinks=False)
        run.chmod(0o555)
        before = snapshot(run)
        # Finished: nothing to write, so a read-only run dir answers as usual.
        proc = _cli(*trainer_cmd(run, *DONE)[3:], user=NOBODY)
        assert proc.returncode == 0 and proc.stderr.startswith("run complete at step 12"), proc.stderr[-2000:]
        _one_error_line(
            _cli(*trainer_cmd(run, "train.steps=14", "checkpoint.every_steps=6")[3:], user=NOBODY),
            f"run.dir {run} is not writable by this user; pick a run.dir you can write",
        )
        assert snapshot(run) == before
        (base / "ro").mkdir(mode=0o555)
        _one_error_line(
            _cli(*trainer_cmd(base / "ro" / "new", *DONE)[3:], user=NOBODY),
            f"run.dir {base}/ro/new cannot be created: {base}/ro is not writable by this user",
        )
        assert list((base / "ro").iterdir()) == []
    finally:
        shutil.rmtree(base)


@pytest.mark.slow
def test_damaged_files_we_wrote_are_rebuilt_or_noted(done, tmp_path):
    run = _copy(done[0], tmp_path / "run")
    good = summary(run)
    (run / "summary.json").write_bytes(b"\x00\x01 torn")
    (run / "heartbeat" / "worker-0.json").write_text('{"phase": "step"}')
    st = _cli("status", str(run))
    assert st.returncode == 0 and "Traceback" not in st.stderr, st.stderr
    assert f"note      {run}/summary.json is damaged" in st.stdout and "COMPLETE" in st.stdout, st.stdout
    proc = subprocess.run(
        trainer_cmd(run, *DONE), cwd=ROOT, capture_output=True, text=True, timeout=120, env=child_env()
    )
    assert proc.returncode == 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("run complete at step 12") and "rebuilt from events.jsonl" in proc.stderr
    rebuilt = summary(run)
    for key in ("final_step", "final_loss", "params_sha256", "n_params", "restarts"):
        assert rebuilt[key] == good[key], key


@pytest.mark.slow
def test_strict_json_and_no_nan_in_what_status_says(tmp_path):
    """A NaN update with the runbook off: the losses are NaN from there on. Every file stays strict JSON."""
    run = tmp_path / "run"
    proc = run_trainer(
        run,
        "train.steps=10",
        "checkpoint.every_steps=0",
        "runbook.enabled=false",
        "log.report=true",
        "faults=[{kind: nan, step: 6}]",
        worker=True,
    )
    assert proc.stderr.splitlines()[-1].startswith(
        f"run complete at step 10: {run}/summary.json (final loss not finite (NaN/Inf))"
    ), proc.stderr[-2000:]
    for line in (run / "events.jsonl").read_text().splitlines():
        _strict(line)
    s = _strict((run / "summary.json").read_text())
    assert s["final_loss"] is None and s["final_step"] == 10
    assert [e["loss"] for e in events(run) if e["event"] == E.STEP][-1] is None
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["10"]  # every_steps=0: the final save only
    out = _cli("status", str(run)).stdout
    assert "final loss not finite (NaN/Inf)" in out and "loss      not finite" in out and "loss nan" not in out, out
    assert (run / "report" / "loss.png").is_file()


@pytest.mark.slow
def test_library_noise_goes_to_the_worker_log_not_the_terminal(tmp_path):
    """XLA's own info lines (TF_CPP_MIN_LOG_LEVEL=0 turns them on: "PjRt-IFRT device count ..." as the
    backend starts) stay in the worker log. (The tiny config's step no longer makes the partitioner warn.)"""
    run = tmp_path / "run"  # the micro model: any model's start-up shows the backend's lines; compiles cold
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "--config",
        TINY,
        *sets(*MICRO, f"run.dir={run}", "train.steps=2", "run.compile_cache="),
    ]
    env = dict(child_env(), TF_CPP_MIN_LOG_LEVEL="0")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PjRt-IFRT device count" in (run / "logs" / "worker-1.log").read_text()
    lines = proc.stderr.splitlines()
    assert "PjRt-IFRT" not in proc.stderr and lines[0].startswith("fresh start:"), proc.stderr[-3000:]
    assert lines[-1].startswith("run complete at step 2"), proc.stderr[-3000:]


def _figures(run: Path, monkeypatch) -> dict[str, object]:
    """The report's figures by file name, captured just before they are saved and closed."""
    figs, save = {}, report._save

    def keep(fig, plt, out):
        figs[Path(out).name] = fig
        save(fig, plt, out)

    monkeypatch.setattr(report, "_save", keep)
    report.write(run, run.parent / f"report-{run.name}")
    return figs


@pytest.mark.slow
def test_report_plots_and_text_say_only_what_happened(done, tmp_path, monkeypatch):
    run = done[0]
    s = summary(run)
    assert s["restarts"] == 0 and s["goodput"]["seconds"]["restart"] < 0.05, s["goodput"]
    assert s["goodput"]["seconds"]["shutdown"] > 0 and set(s["goodput"]["seconds"]) == set(goodput.CATEGORIES)
    figs = _figures(run, monkeypatch)
    assert "downtime.png" not in figs  # no restart: no downtime to draw
    (ax,) = figs["goodput.png"].axes
    labels = ax.get_legend_handles_labels()[1]
    assert not any(lb.startswith("restart") for lb in labels) and ax.get_title().endswith("(0 restarts)"), labels
    (ax,) = figs["loss.png"].axes
    assert ax.get_title() == "Loss" and [ln.get_linestyle() for ln in ax.get_lines()] == ["-"]  # one attempt
    (ax,) = figs["throughput.png"].axes
    marks = sorted(ln.get_xdata()[0] for ln in ax.get_lines() if ln.get_color() == "gray")
    assert marks == [6, 12] == sorted(e["step"] for e in events(run) if e["event"] == E.CHECKPOINT_SAVED), marks
    assert "checkpoint mark" in ax.get_title() and "MFU" in ax.get_title()
    assert [a.get_ylabel() for a in ax.child_axes] == ["MFU % (right axis)"]  # tiny.yaml logs MFU
    # Without an MFU series there is no MFU axis and the title does not promise one.
    bare = _copy(run, tmp_path / "no_mfu")
    recs = [json.loads(x) for x in (bare / "events.jsonl").read_text().splitlines()]
    (bare / "events.jsonl").write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k != "mfu"}) + "\n" for r in recs)
    )
    (ax,) = _figures(bare, monkeypatch)["throughput.png"].axes
    assert not ax.child_axes and "MFU" not in ax.get_title() + " ".join(ax.get_legend_handles_labels()[1])
    # The report's text is status's text, and its goodput table the same ledger.
    md = (run.parent / f"report-{run.name}" / "report.md").read_text()
    shown = status.render(runview.load(run))
    for prefix in ("restarts  0", "goodput   ", "step      12/12"):
        line = next(ln for ln in shown.splitlines() if ln.startswith(prefix)).split("heartbeat")[0]  # ages differ
        assert line in md, (line, md)
    assert "## Restarts, resumes and runbook actions (0)" in md


def test_readme_documents_what_a_newcomer_meets():
    readme = (ROOT / "README.md").read_text()
    for phrase in (
        "checkpoint.every_steps=0",
        "strict JSON",
        "run complete at step",
        "python -m trainer --help",
        "shutdown",
    ):
        assert phrase in readme, phrase
