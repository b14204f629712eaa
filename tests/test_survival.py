"""Run-survival simulator: the lesson's numbers, the sweep, Monte Carlo, --from-run and CLI errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from trainer.store import event_names as E
from trainer.survival import cli
from trainer.survival import model as survival
from trainer.survival.model import Inputs, exact, expectation, recommend_interval_min, sweep

REPO = Path(__file__).resolve().parents[1]
DEFAULT = Inputs()  # 1,024 GPUs, MTBF 50,000 h, 60 min, 21 days, 5 s stall, 10 min restart, MFU 0.45


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_lesson_numbers() -> None:
    m = expectation(DEFAULT)
    assert m["expected_failures"] == pytest.approx(1024 * 21 * 24 / 50_000)  # 10.32192
    assert round(m["expected_failures"], 2) == 10.32
    assert m["lost_per_crash_gpu_hours"] == pytest.approx(512.0)  # half of 60 min on 1,024 GPUs
    assert m["recompute_gpu_hours"] == pytest.approx(10.32192 * 512)
    assert m["checkpoint_overhead_gpu_hours"] == pytest.approx(504 * 5 * 1024 / 3600)  # 504 saves x 5 s
    assert m["restart_gpu_hours"] == pytest.approx(10.32192 * 10 / 60 * 1024)
    total = m["recompute_gpu_hours"] + m["checkpoint_overhead_gpu_hours"] + m["restart_gpu_hours"]
    assert m["wasted_gpu_hours"] == pytest.approx(total)
    assert m["effective_mfu"] == pytest.approx(0.45 * m["run_gpu_hours"] / (m["run_gpu_hours"] + total))
    assert survival.lost_for_crash(6, 1024) == 6144  # the by-hand figure: 6 h x 1,024 GPUs


def test_cli_json_has_the_promised_keys(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "--json", "--since-checkpoint-h", "6")
    assert rc == 0
    report = json.loads(out)
    for key in (
        "expected_failures",
        "lost_per_crash_gpu_hours",
        "recompute_gpu_hours",
        "checkpoint_overhead_gpu_hours",
        "restart_gpu_hours",
        "wasted_gpu_hours",
        "wasted_fraction",
        "effective_mfu",
        "verdict",
    ):
        assert key in report
    assert report["expected_failures"] == pytest.approx(10.32192)
    assert report["lost_per_crash_gpu_hours"] == 512
    assert report["since_checkpoint"]["lost_gpu_hours"] == 6144
    assert report["verdict"] == "healthy"


def test_table_is_readable(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "--since-checkpoint-h", "6")
    assert rc == 0
    assert "10.32" in out and "512.0 GPU-h" in out
    assert "6 h x 1,024 GPUs = 6,144 GPU-hours" in out


def test_sweep_optimum_is_interior_and_matches_young_and_daly() -> None:
    s = sweep(DEFAULT)
    opt = s["optimum_interval_min"]
    assert s["interior"]

    def wasted(t: float) -> float:
        return expectation(replace(DEFAULT, interval_min=t))["wasted_gpu_hours"]

    assert wasted(opt) < min(wasted(opt / 2), wasted(opt * 2))
    assert wasted(opt) < min(wasted(opt * 0.9), wasted(opt * 1.1))
    assert wasted(opt) < min(s["wasted_at_search_edges_gpu_hours"])
    assert s["young_interval_min"] == pytest.approx(math.sqrt(2 * 5 * 50_000 * 3600 / 1024) / 60)  # 22.1 min
    assert opt == pytest.approx(s["young_interval_min"], rel=1e-3)  # first-order model's optimum IS Young's
    assert s["daly_interval_min"] == pytest.approx(opt, rel=0.02)
    assert s["exact_optimum_interval_min"] == pytest.approx(s["daly_interval_min"], rel=0.01)


def test_never_checkpointing_wastes_more_than_the_run_itself() -> None:
    never = replace(DEFAULT, interval_min=None)
    m = expectation(never)
    assert m["checkpoint_overhead_gpu_hours"] == 0
    assert m["wasted_gpu_hours"] > m["run_gpu_hours"]  # ~2.67M vs 516k GPU-hours
    assert m["effective_mfu"] < 0.2 * never.mfu
    ex = exact(never)
    assert ex["practically_never_finishes"]
    assert ex["expected_completion_days"] > 100 * 365  # ~170 years, for a 21-day run
    assert survival.verdict(m, ex)[0] == "practically never finishes"
    assert exact(replace(never, gpus=8192))["expected_completion_days"] > 1e30
    # A far larger cluster overflows a double: the model must still answer, in log space.
    huge = exact(replace(never, gpus=100_000))
    assert huge["expected_completion_days"] is None and huge["expected_completion_log10_days"] > 300


def test_scaling_to_8192_gpus() -> None:
    big = replace(DEFAULT, gpus=8192)
    assert expectation(big)["expected_failures"] == pytest.approx(8 * expectation(DEFAULT)["expected_failures"])
    ratio = sweep(DEFAULT)["optimum_interval_min"] / sweep(big)["optimum_interval_min"]
    assert ratio == pytest.approx(math.sqrt(8), rel=0.01)


def test_exact_model_is_close_to_first_order_when_failures_are_rare() -> None:
    m, ex = expectation(DEFAULT), exact(DEFAULT)
    assert ex["wasted_gpu_hours"] == pytest.approx(m["wasted_gpu_hours"], rel=0.02)
    assert ex["expected_completion_days"] == pytest.approx(
        21 * (1 + m["wasted_gpu_hours"] / m["run_gpu_hours"]), rel=1e-3
    )


def test_monte_carlo_agrees_with_both_models() -> None:
    mc = survival.monte_carlo(DEFAULT, runs=1000, seed=1234)
    m, ex = expectation(DEFAULT), exact(DEFAULT)
    assert mc["agrees_with_expectation"] and mc["agrees_with_exact"]
    assert abs(mc["wasted_gpu_hours"]["mean"] - m["wasted_gpu_hours"]) <= 3 * mc["wasted_gpu_hours"]["se"]
    assert abs(mc["completion_days"]["mean"] - ex["expected_completion_days"]) <= 3 * mc["completion_days"]["se"]
    assert abs(mc["failures"]["mean"] - ex["expected_failures"]) <= 3 * mc["failures"]["se"]
    assert 0 < mc["wasted_gpu_hours"]["se"] < 0.05 * m["wasted_gpu_hours"]
    assert survival.monte_carlo(DEFAULT, runs=200, seed=7) == survival.monte_carlo(DEFAULT, runs=200, seed=7)


def test_monte_carlo_confirms_never_practically_never_finishes() -> None:
    never = replace(DEFAULT, interval_min=None)
    mc = survival.monte_carlo(never, runs=150, seed=3)
    assert mc["agrees_with_exact"] and not mc["agrees_with_expectation"]
    assert mc["completion_days"]["mean"] > 100 * 21
    assert survival.monte_carlo(replace(never, gpus=8192), runs=10, seed=0)["runs"] == 0  # refused, not hung


def test_recommend_interval_min() -> None:
    rec = recommend_interval_min(stall_s=5, restart_s=600, gpus=1024, mtbf_hours=50_000)
    assert rec == pytest.approx(sweep(DEFAULT)["optimum_interval_min"], rel=1e-6)
    assert rec == pytest.approx(recommend_interval_min(stall_s=5, restart_s=60, gpus=1024, mtbf_hours=50_000))
    # Beyond the lesson's 720-minute grid the search widens instead of sticking to its edge.
    lone = recommend_interval_min(stall_s=30, restart_s=60, gpus=1, mtbf_hours=50_000)
    assert lone == pytest.approx(survival.young_min(30, 1, 50_000), rel=1e-3) and lone > 720


def test_import_is_light() -> None:
    code = (
        "import sys, trainer.survival.model, trainer.survival.cli; "
        "print([m for m in ('jax', 'numpy', 'matplotlib') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "u.png"
    rc, out, _ = run_cli(capsys, "--plot", str(png), "--json")
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out)["sweep"]["interior"]


def write_run(run_dir: Path) -> None:
    events = [{"event": E.SESSION_START, "time": 0.0}]
    events += [
        {
            "event": E.STEP,
            "time": float(i),
            "step": i,
            "loss": 3.0,
            "grad_norm": 1.0,
            "lr": 1e-3,
            "tokens_per_s": 1e5,
            "mfu": mfu,
        }
        for i, mfu in enumerate([0.40, 0.42, 0.50])
    ]
    events += [
        {"event": E.CHECKPOINT_SAVED, "time": 10.0 + i, "step": i, "blocking_s": b}
        for i, b in enumerate([2.0, 3.0, 10.0])
    ]
    lines = [json.dumps(e) for e in events] + ["{not json"]
    (run_dir / "events.jsonl").write_text("\n".join(lines) + "\n")
    seconds = {"productive": 1000.0, "recompute": 50.0, "restart": 900.0, "checkpoint": 5.0, "startup": 20.0}
    (run_dir / "summary.json").write_text(json.dumps({"goodput": {"fractions": {}, "seconds": seconds}, "restarts": 3}))


def test_from_run_uses_measurements(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path)
    rc, out, _ = run_cli(capsys, "--from-run", str(tmp_path), "--gpus", "4096", "--json")
    assert rc == 0
    r = json.loads(out)
    assert r["from_run"]["measured"] == {"stall_s": 3.0, "mfu": 0.42, "restart_s": 300.0}
    rec = recommend_interval_min(stall_s=3.0, restart_s=300.0, gpus=4096, mtbf_hours=50_000)
    assert r["from_run"]["recommended_interval_min"] == pytest.approx(rec)
    assert r["inputs"]["interval_min"] == pytest.approx(rec)  # no --interval-min: evaluated at the recommendation
    assert r["inputs"]["restart_min"] == pytest.approx(5.0) and r["inputs"]["mfu"] == 0.42
    assert any("unreadable" in n for n in r["from_run"]["notes"])
    # These step events have no mfu_full_attn: their mfu is the whole-L x L figure logged before issue 47.
    assert any(n.startswith("mfu: median of 3 step events (logged before issue 47") for n in r["from_run"]["notes"])
    rc, out, _ = run_cli(capsys, "--from-run", str(tmp_path), "--interval-min", "30", "--json")
    assert json.loads(out)["inputs"]["interval_min"] == 30


def test_from_run_falls_back_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "--from-run", str(tmp_path), "--stall-s", "7")
    assert rc == 0
    assert "stall_s not measured: using --stall-s" in out and "restart_s not measured" in out
    assert "recommended interval for 1,024 GPUs" in out
    (tmp_path / "summary.json").write_text(json.dumps({"goodput": {"seconds": {"restart": 0.0}}, "restarts": 0}))
    rc, out, _ = run_cli(capsys, "--from-run", str(tmp_path), "--json")
    assert json.loads(out)["inputs"]["restart_min"] == 10


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--gpus", "-5"], "--gpus"),
        (["--gpus", "2.5"], "--gpus"),
        (["--mtbf-hours", "0"], "--mtbf-hours"),
        (["--interval-min", "-1"], "--interval-min"),
        (["--interval-min", "sometimes"], "--interval-min"),
        (["--days", "nan"], "--days"),
        (["--stall-s", "-1"], "--stall-s"),
        (["--restart-min", "-3"], "--restart-min"),
        (["--mfu", "0"], "--mfu"),
        (["--mfu", "45"], "--mfu"),
        (["--monte-carlo", "1"], "--monte-carlo"),
        (["--from-run", "/nonexistent/run"], "--from-run"),
        (["--bogus"], "--bogus"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv: list[str], option: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and option in err and "Traceback" not in err


def test_real_cli_entry_point_errors_cleanly() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "survival", "--gpus", "-5"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "--gpus" in proc.stderr
