"""Running the real trainer for a benchmark: subprocess launch and teardown, run-dir readers, the
per-benchmark command line, and the provenance (machine, versions, commit) results carry. No jax here:
the orchestrator and the GPU script use it too.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


class BenchError(RuntimeError):
    """A benchmark could not measure what it set out to (a run failed, an event never came)."""


def child_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", **extra)


def trainer_cmd(config: str, run_dir: Path, *overrides: str, worker: bool = False) -> list[str]:
    sets = [a for o in (f"run.dir={run_dir}", *overrides) for a in ("--set", o)]
    return [sys.executable, "-m", "trainer", "--config", config, *sets, *(["--worker"] if worker else [])]


class Proc:
    """A child process in its own session, output to a log file, killed as a group on the way out."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str] | None = None):
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        self.t_launch = time.time()
        with open(log, "ab") as fh:
            self.popen = subprocess.Popen(
                cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env or child_env(), start_new_session=True
            )

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise BenchError(f"timed out after {timeout:.0f}s: see {self.log}\n{tail(self.log)}") from None

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait()

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def run(cmd: list[str], log: Path, *, timeout: float, env: dict[str, str] | None = None, ok=(0,)) -> float:
    """Run to completion; returns the wall seconds. A non-zero exit is a BenchError with the log's tail."""
    with Proc(cmd, log, env) as p:
        code = p.wait(timeout)
        if code not in ok:
            raise BenchError(f"{' '.join(cmd[:6])} ... exited {code}: see {log}\n{tail(log)}")
        return time.time() - p.t_launch


def tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def events(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "events.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line torn by a kill
            pass
    return sorted(out, key=lambda e: e["time"])  # supervisor events are held back, then written late


def summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def heartbeat(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / "heartbeat" / "worker-0.json").read_text())
    except (OSError, ValueError):
        return None


def wait_for(what: str, cond: Callable[[], object], *, timeout: float, proc: Proc | None = None, poll_s: float = 0.05):
    """Poll until cond() is truthy; fail early when the process we watch has died."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        if proc is not None and proc.popen.poll() is not None:
            raise BenchError(f"process exited ({proc.popen.returncode}) while waiting for {what}\n{tail(proc.log)}")
        time.sleep(poll_s)
    raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}" + (f"\n{tail(proc.log)}" if proc else ""))


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes, all their threads (dead ones count 0)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def per_call(fn, n: int) -> float:
    """Seconds per call of `fn`, over `n` calls (a part of the trainer timed alone)."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def mean_2se(xs: list[float]) -> list[float]:
    """[mean, 2 standard errors] of a benchmark's per-pair ratios."""
    return [statistics.mean(xs), 2 * statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan")]


def steps(evs: list[dict]) -> list[dict]:
    return [e for e in evs if e["event"] == "step"]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def machine() -> dict:
    info = Path("/proc/cpuinfo")
    names = [
        line.split(":", 1)[1].strip()
        for line in (info.read_text().splitlines() if info.is_file() else [])
        if line.startswith("model name")
    ]
    cpu = names[0] if names else platform.processor()
    import psutil

    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "gpu": gpus(),
    }


def gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    return [line for line in out.stdout.splitlines() if line.startswith("GPU")]


VERSIONS = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy", "tensorboardX")


def versions() -> dict:
    out = {}
    for pkg in VERSIONS:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def git(root: Path = ROOT) -> dict:
    """The commit and the count of uncommitted files; both None where there is no git or no repository (a
    copy of the tree on another machine): a result is still written, only without them."""

    def sh(*cmd: str) -> str | None:
        try:
            p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):  # no git on PATH, or it hung
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    commit, dirty = sh("git", "rev-parse", "HEAD"), sh("git", "status", "--porcelain")
    return {"commit": commit, "uncommitted_files": None if dirty is None else len(dirty.splitlines())}


def provenance() -> dict:
    """What produced a result: the machine, package versions and the commit."""
    return {"machine": machine(), "versions": versions(), "git": git()}


def cli(description: str, argv: list[str] | None = None, *, sets: bool = False) -> argparse.Namespace:
    """The flags every benchmark module takes (run alone: `python -m benchmarks.NAME --quick`); `sets` adds
    --set KEY=VALUE for benchmarks that run the trainer (what a component costs: switch it off)."""
    p = argparse.ArgumentParser(description=description)
    if sets:
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="config override for the trainer's runs, e.g. checkpoint.every_steps=0",
        )
    p.add_argument("--quick", action="store_true", help="few steps: checks the benchmark runs, numbers mean little")
    p.add_argument("--work", type=Path, default=None, help="scratch dir for run dirs and logs (default: a tmp dir)")
    p.add_argument("--out", type=Path, default=None, help="write the result JSON here (default: stdout only)")
    p.add_argument("--input", type=Path, default=None, help="results of an earlier benchmark this one builds on")
    args = p.parse_args(argv)
    if args.work is None:
        args.work = Path(f"/tmp/trainer-bench-{os.getpid()}")
    args.work.mkdir(parents=True, exist_ok=True)
    return args


def emit(args: argparse.Namespace, result: dict) -> None:
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
