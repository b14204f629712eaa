"""The survival page in real headless chromium: its JS must give Python's numbers and react to its sliders.

Talks the DevTools protocol over --remote-debugging-pipe (fds 3/4, NUL-framed JSON), so it needs no pip package.
Install the browser with `bash .ci/install-chromium.sh`; without it the test skips, or fails when CI is set.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from trainer.survival import cli
from trainer.survival import model as survival
from trainer.survival.model import Inputs, exact, expectation, recommend_interval_min

CHROMIUM = "/usr/bin/chromium"
READOUTS = [
    "expected_failures",
    "lost_per_crash_gpu_hours",
    "recompute_gpu_hours",
    "checkpoint_overhead_gpu_hours",
    "restart_gpu_hours",
    "wasted_gpu_hours",
    "wasted_fraction",
    "effective_mfu",
    "optimum_interval",
    "young_interval",
    "expected_completion_days",
    "verdict",
]


class Chromium:
    """One headless browser, driven over the DevTools pipe."""

    def __init__(self) -> None:
        self.profile = tempfile.mkdtemp(prefix="survival-chromium-")
        to_r, self.to_w = os.pipe()
        self.from_r, from_w = os.pipe()

        def wire() -> None:  # the child must see the pipe at fds 3 (commands in) and 4 (replies out)
            a, b = fcntl.fcntl(to_r, fcntl.F_DUPFD, 10), fcntl.fcntl(from_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={self.profile}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            [CHROMIUM, *flags],
            preexec_fn=wire,
            close_fds=False,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_r)
        os.close(from_w)
        self.buf, self.next_id, self.session = b"", 0, None

    def call(self, method: str, params: dict[str, Any] | None = None, timeout: float = 30.0) -> dict[str, Any]:
        self.next_id += 1
        msg: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if self.session and not method.startswith(("Target.", "Browser.")):
            msg["sessionId"] = self.session
        os.write(self.to_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self.buf:
                raw, self.buf = self.buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self.next_id:
                    assert "error" not in reply, reply
                    return reply["result"]
            ready, _, _ = select.select([self.from_r], [], [], max(deadline - time.monotonic(), 0))
            chunk = os.read(self.from_r, 1 << 16) if ready else b""
            if not chunk:
                raise TimeoutError(f"chromium did not answer {method}")
            self.buf += chunk

    def open(self, url: str) -> None:
        if self.session is None:
            target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.js("window.previous_page = true")  # so the wait below cannot see the page being left
        self.call("Page.navigate", {"url": url})
        ready = "!window.previous_page && document.readyState === 'complete' && !!$('verdict').textContent"
        deadline = time.monotonic() + 30
        while not self.js(f"(() => {{ try {{ return {ready}; }} catch (e) {{ return false; }} }})()"):
            assert time.monotonic() < deadline, f"{url} never rendered"
            time.sleep(0.05)

    def js(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def readouts(self) -> dict[str, str]:
        return self.js(f"Object.fromEntries({json.dumps(READOUTS)}.map((k) => [k, $(k).textContent]))")

    def slide(self, field: str, value: float) -> None:
        """Move a slider the way a user does: set its value, then fire the input event the page listens to."""
        self.js(
            f"(() => {{ const el = $({json.dumps(field)}); el.value = {value}; "
            "el.dispatchEvent(new Event('input', {bubbles: true})); })()"
        )

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
            self.proc.wait(timeout=10)
        except (OSError, TimeoutError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        os.close(self.to_w)
        os.close(self.from_r)
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser() -> Iterator[Chromium]:
    if not os.access(CHROMIUM, os.X_OK):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} missing in CI: run bash .ci/install-chromium.sh")
        pytest.skip(f"{CHROMIUM} not installed (bash .ci/install-chromium.sh)")
    b = Chromium()
    yield b
    b.close()


def page_for(inp: Inputs, tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    argv = [
        "--gpus",
        str(inp.gpus),
        "--mtbf-hours",
        str(inp.mtbf_hours),
        "--days",
        str(inp.days),
        "--interval-min",
        "never" if inp.interval_min is None else str(inp.interval_min),
        "--stall-s",
        str(inp.stall_s),
        "--restart-min",
        str(inp.restart_min),
        "--mfu",
        str(inp.mfu),
        "--html",
        str(path),
    ]
    assert cli.main(argv) == 0
    text = path.read_text()
    assert "http://" not in text and "https://" not in text and "<script src" not in text  # self-contained
    return path.as_uri()


def python_readouts(inp: Inputs) -> dict[str, str]:
    """What the page must display, formatted to its precision."""
    m, ex = expectation(inp), exact(inp)
    opt = recommend_interval_min(
        stall_s=inp.stall_s, restart_s=inp.restart_min * 60, gpus=inp.gpus, mtbf_hours=inp.mtbf_hours
    )
    days = ex["expected_completion_log10_days"]
    out = {k: f"{m[k]:,.1f}" for k in READOUTS if k.endswith("_gpu_hours")}
    return out | {
        "expected_failures": f"{m['expected_failures']:,.2f}",
        "wasted_fraction": f"{100 * m['wasted_fraction']:,.2f}%",
        "effective_mfu": f"{m['effective_mfu']:.4f}",
        "optimum_interval": f"{opt:,.1f}",
        "young_interval": f"{survival.young_min(inp.stall_s, inp.gpus, inp.mtbf_hours):,.1f}",
        "expected_completion_days": f"{10**days:,.2f}" if days < 6 else f"10^{days:.1f}",
        "verdict": survival.verdict(m, ex)[0],
    }


def number(text: str) -> float:
    return float(text.replace(",", "").rstrip("%"))


def test_page_matches_python_at_defaults_and_reacts_to_sliders(browser: Chromium, tmp_path: Path) -> None:
    base = Inputs()
    browser.open(page_for(base, tmp_path, "default.html"))
    shown = browser.readouts()
    assert shown == python_readouts(base)
    assert shown["expected_failures"] == "10.32" and shown["lost_per_crash_gpu_hours"] == "512.0"
    assert browser.js("document.querySelectorAll('#chart polygon').length") == 3  # recompute, overhead, restart
    assert browser.js("!!document.getElementById('optimum_marker')")

    browser.slide("gpus", 8192)  # 8x the GPUs: ~8x the failures, optimum shrinks ~sqrt(8)
    big = browser.readouts()
    assert big == python_readouts(replace(base, gpus=8192))
    assert number(big["expected_failures"]) == pytest.approx(8 * number(shown["expected_failures"]), rel=1e-3)
    assert number(shown["optimum_interval"]) / number(big["optimum_interval"]) == pytest.approx(8**0.5, rel=0.02)

    browser.slide("gpus", 1024)
    browser.slide("interval_min", 720)  # past the optimum the recompute side of the U rises
    assert number(browser.readouts()["wasted_gpu_hours"]) > number(shown["wasted_gpu_hours"])
    browser.js("$('never').click(); $('never').checked")
    never = browser.readouts()
    assert never == python_readouts(replace(base, interval_min=None))
    assert never["verdict"] == "practically never finishes"
    assert number(never["wasted_gpu_hours"]) > expectation(base)["run_gpu_hours"]
    assert number(never["effective_mfu"]) < 0.2 * base.mfu


def test_page_keeps_measured_values_off_the_slider_grid(browser: Chromium, tmp_path: Path) -> None:
    # As --from-run would produce: a 3.27 s stall must not snap to the slider's 0.5 s step.
    measured = Inputs(gpus=3000, mtbf_hours=40_000, interval_min=45, days=30, stall_s=3.27, restart_min=7.5, mfu=0.38)
    browser.open(page_for(measured, tmp_path, "measured.html"))
    assert browser.readouts() == python_readouts(measured)
