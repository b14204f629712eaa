"""Dashboard: every TensorBoard scalar group read back with TensorBoard's own event reader, alerts raised
by injected faults in a real supervised run (slow steps, a rising ECC count, a hang), a real data-caused
spike seen in grad norm no later than in loss, and the health collector kept off the hot path."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, child_env, events, run_trainer, tensorboard, trainer_cmd

from trainer.config import Config
from trainer.observe import alerts, health
from trainer.store import event_names as E

STEP_TIMEOUT_S, OVERDUE_FRACTION, POLL_S = 8, 0.25, 0.5
FAULTS = "faults=[{kind: ecc, step: 8}, {kind: slow, step: 14, seconds: 0.4, count: 5}, {kind: hang, step: 33}]"
RUN = [
    "train.steps=40",
    "checkpoint.every_steps=20",
    "log.report=true",
    "log.health_every_s=0.05",
    "alerts.throughput_window=10",
    "alerts.throughput_steps=3",
    f"supervisor.step_timeout_s={STEP_TIMEOUT_S}",
    f"supervisor.poll_s={POLL_S}",
    f"alerts.overdue_fraction={OVERDUE_FRACTION}",
    FAULTS,
]


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    """One supervised run: ECC rising from step 8, five slow steps from 14, a hang at 33 (killed, restarted).
    `status` is run while the worker hangs, to see the overdue step from the heartbeat."""
    run = tmp_path_factory.mktemp("dashboard")
    log = open(run.parent / f"{run.name}.log", "w")
    proc = subprocess.Popen(trainer_cmd(run, *RUN), cwd=ROOT, env=child_env(), stdout=log, stderr=log)
    status_during_hang = ""
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        hb = _heartbeat(run)
        if (
            not status_during_hang
            and hb
            and hb["phase"] == "step"
            and hb["step"] == 33
            # overdue, and a supervisor poll since has raised its alert (the kill comes at STEP_TIMEOUT_S)
            and time.time() - hb["time"] > OVERDUE_FRACTION * STEP_TIMEOUT_S + POLL_S
        ):
            status_during_hang = subprocess.run(
                [sys.executable, "-m", "trainer", "status", str(run)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
        time.sleep(0.1)
    assert proc.wait(timeout=max(deadline - time.time(), 1)) == 0, (run.parent / f"{run.name}.log").read_text()[-3000:]
    return run, status_during_hang


def _heartbeat(run: Path) -> dict | None:
    try:
        return json.loads((run / "heartbeat" / "worker-0.json").read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.slow
def test_tensorboard_has_every_scalar_group(faulty_run):
    run, _ = faulty_run
    acc = tensorboard(run / "tb")
    scalars = set(acc.Tags()["scalars"])
    for tag in (
        "loss/train",
        "optim/grad_norm",
        "optim/update_norm",
        "optim/lr",
        "throughput/tokens_per_s",
        "throughput/mfu",
        "time/step_s",
        "time/data_wait_s",
        "time/compute_s",
        "time/ckpt_block_s",
        "health/host/cpu_percent",
        "health/host/mem_used_gb",
        "health/host/ecc_injected",
        "alerts/throughput_drop",
        "alerts/ecc_rising",
        "alerts/open",
        "goodput/productive_fraction",
        "goodput/restart_s",
        "goodput/restarts",
        "markers/restart",
        "markers/hang",
        "markers/checkpoint_now",
    ):
        assert tag in scalars, (tag, sorted(scalars))
    assert all(0 < e.value < 1 for e in acc.Scalars("throughput/mfu"))  # nominal CPU peak from tiny.yaml
    assert [e.step for e in acc.Scalars("markers/restart")] == [e.step for e in acc.Scalars("markers/hang")] == [33]
    ecc = [e["step"] for e in events(run) if e["event"] == E.CHECKPOINT_NOW]
    assert [e.step for e in acc.Scalars("markers/checkpoint_now")] == ecc and len(ecc) == 1
    assert max(e.value for e in acc.Scalars("goodput/restarts")) == 1
    texts = set(acc.PluginTagToContent("text"))
    assert {"config/text_summary", "alerts/text_summary", "markers/text_summary"} <= texts
    assert "_hparams_/experiment" in acc.PluginTagToContent("hparams")  # the resolved config as hparams


@pytest.mark.slow
def test_injected_faults_raise_their_alerts(faulty_run):
    run, status_during_hang = faulty_run
    evs = events(run)
    raised = [e for e in evs if e["event"] == E.ALERT]
    for a in raised:
        assert a["meaning"] and a["runbook"] == alerts.ALERTS[a["kind"]][1]
    # Slow steps 14-18 (0.4 s on ~0.05 s steps): the throughput alert fires inside that stretch.
    assert any(a["kind"] == "throughput_drop" and 14 <= a["step"] <= 19 for a in raised), raised
    # ECC rising from step 8: alert, checkpoint-now event, and the loop saves for that reason right away.
    ecc = next(a for a in raised if a["kind"] == "ecc_rising")
    assert 8 <= ecc["step"] <= 12 and ecc["action"] == "checkpoint_now"
    assert any(e["event"] == E.CHECKPOINT_NOW and e["step"] == ecc["step"] for e in evs)
    saved = next(e for e in evs if e["event"] == E.CHECKPOINT_SAVED and e["reason"] == "ecc_rising")
    assert saved["step"] == ecc["step"] + 1
    # The hang at step 33: the supervisor warns before its timeout kills the worker, and clears it after.
    kinds = [(e["event"], e.get("kind")) for e in evs]
    i_alert, i_hang = kinds.index((E.ALERT, "step_overdue")), kinds.index((E.HANG_DETECTED, None))
    assert i_alert < i_hang < kinds.index((E.ALERT_CLEARED, "step_overdue"))
    assert "OVERDUE" in status_during_hang and "step_overdue" in status_during_hang, status_during_hang
    # The supervisor wrote the report when the run completed.
    assert "restart" in (run / "report" / "report.md").read_text()


def _spike_corpus(path: Path, at_step: int, per_step: int) -> None:
    """Python source text with a corrupt block (1 KiB of 0xFF, as in a damaged file) exactly where data
    batch `at_step` reads it (shuffle off: batch k = bytes [k * per_step, (k + 1) * per_step))."""
    import sysconfig

    std = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join(p.read_bytes() for p in sorted(std.glob("*.py"))[:40])
    path.mkdir()
    (path / "corpus.txt").write_bytes(
        text[: at_step * per_step] + b"\xff" * per_step + text[at_step * per_step : (at_step + 12) * per_step]
    )


def _first_spike(series: dict[int, float], window: int = 10, z: float = 6.0) -> int | None:
    """First step more than `z` sigmas above the linear trend of the `window` steps before it (early
    training falls fast: a spike is a break from the trend, not from a flat median)."""
    steps = sorted(series)
    for i in range(window, len(steps)):
        xs = np.array(steps[i - window : i], dtype=float)
        ys = np.array([series[s] for s in steps[i - window : i]])
        fit = np.polyfit(xs, ys, 1)
        sigma = (ys - np.polyval(fit, xs)).std(ddof=2)
        if series[steps[i]] > np.polyval(fit, steps[i]) + z * max(sigma, 1e-6):
            return steps[i]
    return None


@pytest.mark.slow
def test_data_spike_shows_in_grad_norm_no_later_than_in_loss(tmp_path):
    data_dir = tmp_path / "data"
    _spike_corpus(data_dir, at_step=20, per_step=16 * 64)  # MICRO: batch 16 x seq_len 64
    runbook_off = ["runbook.enabled=false"] if "runbook" in Config.__dataclass_fields__ else []
    run = tmp_path / "run"
    run_trainer(run, f"data.path={data_dir}", "data.shuffle=false", *runbook_off, "log.report=true", worker=True)
    steps = [e for e in events(run) if e["event"] == E.STEP]
    grad = _first_spike({e["step"]: e["grad_norm"] for e in steps})
    loss = _first_spike({e["step"]: e["loss"] for e in steps})
    assert grad == 21, grad  # step 21 trains on data batch 20: the corrupt block
    assert loss is not None and grad <= loss
    # Unsupervised runs write their report too.
    assert (run / "report" / "loss.png").is_file()


def test_the_tensorboard_writer_does_not_import_torch(tmp_path):
    """torch is installed for the export check (.ci/install-transformers.sh); tensorboardX imports it when it
    can, which costs seconds at every worker start and every supervisor ledger write."""
    import importlib.util
    import os

    if importlib.util.find_spec("torch") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("torch is not installed under CI: run .ci/install-transformers.sh")
        pytest.skip("torch is not installed: nothing to keep out")
    code = (
        "import sys\nfrom trainer.observe.tensorboard import Writer\n"
        f"w = Writer({str(tmp_path)!r})\nw.add(1, {{'loss/train': 1.0}})\nw.close()\nprint('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=child_env()
    )
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr[-2000:]
    assert [e.value for e in tensorboard(tmp_path).Scalars("loss/train")] == [1.0]


class _SlowSource:
    """A driver call stuck for half a second; notes how many of the loop's calls (`calls`, counted by the test)
    completed while each of its reads was stuck."""

    name = "slow"

    def __init__(self):
        self.calls, self.during = 0, []

    def read(self):
        before = self.calls
        time.sleep(0.5)
        self.during.append(self.calls - before)
        return {"gpu0": {"ecc_corrected": 0.0}}

    def close(self):
        pass


def test_health_collector_is_off_the_hot_path_and_works_without_nvml():
    sources, why = health.open_sources()
    assert sources[-1].name == "host" and (why or sources[0].name == "nvml")
    snap = health.HealthCollector(every_s=60, sources=sources).sample()
    assert {"mem_used_gb", "mem_percent", "cpu_percent", "rss_gb"} <= set(snap["devices"]["host"])
    src = _SlowSource()
    c = health.HealthCollector(every_s=0.01, sources=[src], injected_ecc=lambda step: 3 * step).start()
    t0 = time.perf_counter()
    while len(src.during) < 2 and time.perf_counter() - t0 < 60:
        c.step = 7
        c.latest()  # what the loop does each step: never waits for the stuck source
        src.calls += 1
    # Judged against the stuck reads themselves, not a rate per wall-clock second: the loop went on calling
    # latest() while each read was stuck (one that waited for the read would finish at most one call per read).
    assert len(src.during) == 2 and min(src.during) > 1, src.during
    snap = c.latest()
    assert snap is not None and health.ecc_total(snap) == 21.0  # injected errors are counted with the rest
    c.stop()


class _Sink:
    """Stands in for the EventLog and Scalars the loop passes in: records what the monitors write."""

    def __init__(self):
        self.events, self.scalars = [], {}

    def write(self, event, step=None, **fields):
        self.events.append(dict(fields, event=event, step=step))

    def add(self, step, values):
        for k, v in values.items():
            self.scalars.setdefault(k, []).append((step, v))

    def text(self, tag, text, step=0):
        pass


def test_grad_norm_trend_alert_fires_on_a_climb_and_clears():
    sink = _Sink()
    mon = alerts.GradNormTrend(alerts.Alerter(sink, sink), window=20, rise=2.0, start_step=5)
    rng = np.random.default_rng(0)
    series = [1.0 + 0.1 * rng.standard_normal() for _ in range(60)]  # flat and noisy: no alert
    series += [1.0 * 1.05**i for i in range(40)]  # +5% a step: x7 over 40 steps
    series += [1.0] * 60
    for step, g in enumerate(series, 1):
        mon.on_step(step, {"grad_norm": g})
    fired = [e for e in sink.events if e["event"] == E.ALERT]
    assert len(fired) == 1 and 60 < fired[0]["step"] <= 100
    assert any(e["event"] == E.ALERT_CLEARED for e in sink.events)


def _fake_nvml(ecc: list[int]):
    """A stand-in for the nvidia-ml-py module (CI has no GPU): two GPUs, the second without ECC support,
    one pending Xid event. Names and signatures as in nvidia-ml-py 12/13."""
    import types

    nv = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class Handle:
        def __init__(self, i):
            self.i = i

    nv.NVMLError = NVMLError
    nv.NVML_TEMPERATURE_GPU, nv.NVML_VOLATILE_ECC, nv.NVML_CLOCK_SM = 0, 0, 1
    nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
    nv.nvmlClocksThrottleReasonHwSlowdown, nv.nvmlClocksThrottleReasonSwThermalSlowdown = 0x8, 0x20
    nv.nvmlClocksThrottleReasonHwThermalSlowdown, nv.nvmlClocksThrottleReasonHwPowerBrakeSlowdown = 0x40, 0x80
    nv.nvmlEventTypeXidCriticalError = 8
    pending = [types.SimpleNamespace(device=Handle(1), eventData=79)]

    def ecc_errors(h, kind, counter):
        if h.i == 1:
            raise NVMLError("Not Supported")
        return ecc[0] if kind == 0 else 0

    def wait(events, timeout_ms):
        if not pending:
            raise NVMLError("Timeout")
        return pending.pop()

    nv.__dict__.update(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=Handle,
        nvmlDeviceGetIndex=lambda h: h.i,
        nvmlDeviceGetTemperature=lambda h, s: 60 + h.i,
        nvmlDeviceGetPowerUsage=lambda h: 350_000,
        nvmlDeviceGetClockInfo=lambda h, kind: 1980 - 500 * h.i,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=40 * health.GB),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=97),
        nvmlDeviceGetTotalEccErrors=ecc_errors,
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 0x40 * h.i,
        nvmlEventSetCreate=lambda: object(),
        nvmlDeviceRegisterEvents=lambda h, kind, events: None,
        nvmlEventSetWait=wait,
        nvmlEventSetFree=lambda events: None,
    )
    return nv


def test_every_nvml_call_exists_in_the_installed_nvidia_ml_py_with_a_signature_that_takes_it():
    """CI has no GPU, so the NVML source runs against the fake above; this pins both to the real library's
    API surface: every name trainer/observe/health.py reads from the module, and every name the fake stands
    in for, exists in the installed nvidia-ml-py, and each call's argument count binds to its signature."""
    import ast
    import inspect

    import pynvml  # nvidia-ml-py, a test dependency (pyproject's test extra)

    used: dict[str, int | None] = {}  # name -> positional arguments of a call (None: read, not called)
    for node in ast.walk(ast.parse(Path(health.__file__).read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("nv", "pynvml"):
            used.setdefault(node.attr, None)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if isinstance(node.func.value, ast.Name) and node.func.value.id in ("nv", "pynvml"):
                used[node.func.attr] = len(node.args)
    assert len(used) >= 20, sorted(used)  # the parse found the calls (a refactor renaming `nv` would hide them)
    for name, nargs in used.items():
        real = getattr(pynvml, name, None)
        assert real is not None, f"pynvml has no {name}"
        if nargs is not None:
            inspect.signature(real).bind(*range(nargs))  # raises TypeError if the call could not take them
    fake = {k: v for k, v in vars(_fake_nvml([0])).items() if k.startswith(("nvml", "NVML"))}
    assert set(used) - {"NVMLError"} <= set(fake), set(used) - set(fake)  # the fake covers what the source uses
    for name, stand_in in fake.items():
        real = getattr(pynvml, name, None)
        assert real is not None, f"the fake's {name} is not in pynvml"
        if callable(stand_in) and not isinstance(stand_in, type):
            n = len(inspect.signature(stand_in).parameters)
            inspect.signature(real).bind(*range(n))
    assert issubclass(pynvml.NVMLError, Exception)


def test_nvml_source_reads_every_gpu_and_a_rising_ecc_count_asks_for_a_checkpoint(monkeypatch):
    ecc = [0]
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(ecc))
    sources, why = health.open_sources()
    assert [s.name for s in sources] == ["nvml", "host"] and not why
    collector = health.HealthCollector(every_s=60, sources=sources)
    sink = _Sink()
    mon = alerts.HealthMonitor(alerts.Alerter(sink, sink), collector, every_steps=1, ecc_rise=1)
    collector.sample()
    assert mon.on_step(1, {}) is None  # the first sample is the baseline
    gpu0, gpu1 = collector.latest()["devices"]["gpu0"], collector.latest()["devices"]["gpu1"]
    assert gpu0["temp_c"] == 60 and gpu0["power_w"] == 350 and gpu0["mem_used_gb"] == 40 and gpu0["throttled"] == 0
    assert (gpu0["sm_clock_mhz"], gpu1["sm_clock_mhz"]) == (1980, 1480)
    assert "ecc_corrected" not in gpu1 and gpu1["throttled"] == 1 and gpu1["xid_count"] == 1 and gpu1["last_xid"] == 79
    assert "health/gpu1/temp_c" in sink.scalars
    ecc[0] = 3
    collector.sample()
    assert mon.on_step(2, {}) == {"do": "checkpoint_now", "reason": "ecc_rising"}
    alert = next(e for e in sink.events if e["event"] == E.ALERT)
    assert alert["kind"] == "ecc_rising" and alert["devices"] == ["gpu0"] and "gpu0 +3" in alert["detail"]
    sources[0].close()
