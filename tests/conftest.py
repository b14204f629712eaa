"""Shared test helpers: a micro config for fast real runs, and readers for a run dir's outputs."""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from jaxlib import xla_client

from trainer.store import event_names as E

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
# One JAX compilation cache per test session, empty at its start as on a fresh CI machine (not the user's
# ~/.cache): every later run of a micro config loads its compiled step instead of compiling it again. The
# first process to load this file makes it (under pytest-xdist, the controller, before it starts the
# workers) and the workers inherit it through the environment, so each config compiles once per session,
# not once per worker; trainer processes share it already. A hit is the executable a miss would build, so
# bitwise comparisons across runs hold (test_supervisor.py checks a restart from the cache against an
# uninterrupted run).
COMPILE_CACHE = os.environ.get("TRAINER_TESTS_COMPILE_CACHE", "")
if not COMPILE_CACHE:
    COMPILE_CACHE = os.environ["TRAINER_TESTS_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="trainer-tests-jax-cache-")
    atexit.register(shutil.rmtree, COMPILE_CACHE, True)

# XLA:CPU's LLVM back end set for what each kind of process does with it. This process (each pytest worker)
# compiles about a hundred distinct small programs, once each: the back end at its cheapest halves their CPU
# (tests/test_model.py: 95 -> 45 CPU-s). Trainer processes run a few programs, loaded from the session's
# compile cache, for tens to hundreds of steps: there optimisation level 0 makes a micro step 1.8x slower
# (70 against 39 ms on 2 cores) for 2 CPU-s saved once per config, so they get level 1, which compiles nearly
# as cheaply (a cold 100-step run 23 CPU-s against 27 at level 0) and steps as fast as the default.
# XLA reads XLA_FLAGS once per process, when the first compile options are built: this process reads the
# cheap setting now, then the environment every child inherits (supervisors, workers, SLURM tasks) says the
# other. XLA's HLO passes (fusion, SPMD partitioning, the collectives tests/test_sharding.py reads from the
# dump) depend on neither. Every bitwise comparison is between trainer runs of this session, all compiled
# the same way; none compares with a run made outside it.
IN_PROCESS_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
SUITE_XLA_FLAGS = "--xla_backend_optimization_level=1 --xla_llvm_disable_expensive_passes=true"
_ours = {*IN_PROCESS_XLA_FLAGS.split(), *SUITE_XLA_FLAGS.split()}
_user_xla_flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f not in _ours)
os.environ["XLA_FLAGS"] = f"{_user_xla_flags} {IN_PROCESS_XLA_FLAGS}".strip()
xla_client.CompileOptions()
os.environ["XLA_FLAGS"] = f"{_user_xla_flags} {SUITE_XLA_FLAGS}".strip()

# The tiny config shrunk further so a real run of a few dozen steps takes seconds on 2 cores. No end-of-run
# report (matplotlib, ~2 s a run): the tests of the report and of its being written turn it back on.
MICRO = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.seq_len=64",
    "data.batch_size=16",
    "train.steps=30",
    "optim.warmup_steps=5",
    "log.every_steps=5",
    "checkpoint.every_steps=10",
    "log.progress=false",
    "data.default_corpus_mb=1",
    "log.report=false",
    f"run.compile_cache={COMPILE_CACHE}",
]


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def trainer_cmd(run_dir: Path, *overrides: str, worker: bool = False, config: str = TINY) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trainer",
        "--config",
        config,
        *sets(*MICRO, f"run.dir={run_dir}", *overrides),
        *(["--worker"] if worker else []),
    ]


def run_trainer(
    run_dir: Path,
    *overrides: str,
    worker: bool = False,
    timeout: float = 600,
    check: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        trainer_cmd(run_dir, *overrides, worker=worker),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(child_env(), **(env or {})),
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"trainer exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1")


def snapshot(d: Path) -> dict[str, tuple]:
    """Every path under d: mode, size, mtime and the sha256 of its bytes (a run dir left alone compares equal)."""
    out = {}
    for p in sorted([d, *d.rglob("*")]):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        out[str(p.relative_to(d))] = (st.st_mode, st.st_size if p.is_file() else 0, st.st_mtime_ns, digest)
    return out


def events(run_dir: Path) -> list[dict]:
    out = []
    for line in (Path(run_dir) / "events.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def step_losses(run_dir: Path) -> dict[int, list[float]]:
    """Every loss logged for every step, across all attempts (a recomputed step logs twice)."""
    out: dict[int, list[float]] = {}
    for e in events(run_dir):
        if e["event"] == E.STEP:
            out.setdefault(e["step"], []).append(e["loss"])
    return out


def summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def need_transformers():
    """(torch, transformers), imported; a skip where they are not installed, except under CI, which installs
    them (.ci/install-transformers.sh) and so fails instead."""
    try:
        import torch
        import transformers
    except ImportError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{e.name} missing in CI: run bash .ci/install-transformers.sh")
        pytest.skip(f"{e.name} not installed (bash .ci/install-transformers.sh)")
    return torch, transformers


def built_once(tmp_path_factory, name: str, build) -> Path:
    """Directory `name`, made by build(dir) once per test session and shared by the pytest-xdist workers:
    the first to ask builds it under a file lock, the others wait for it. For reference runs, which are
    deterministic (any worker's is bit for bit the one another would build): each costs a run, not two."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "built-once"
    shared.mkdir(exist_ok=True)
    d, done = shared / name, shared / f"{name}.done"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(d, ignore_errors=True)  # a build that failed in another worker
            d.mkdir()
            build(d)
            done.touch()
    return d


def _effective(overrides: tuple[str, ...]) -> str:
    from trainer.config import load_config, to_dict

    tree = to_dict(load_config(TINY, [*MICRO, *overrides]))
    tree["run"].pop("dir")
    return json.dumps(tree, sort_keys=True)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """One uninterrupted micro run (unsupervised) that the fault tests compare against, by mesh."""

    def get(*overrides: str) -> Path:
        # Keyed by the config the overrides make, not their spelling: the tiny config's own mesh spelled out
        # is the run with no overrides, built once.
        key = hashlib.sha256(_effective(overrides).encode()).hexdigest()[:16]
        return built_once(tmp_path_factory, f"reference-{key}", lambda d: run_trainer(d, *overrides, worker=True))

    return get


def _storage_server(kind: str):
    """A real storage server on loopback (tests/buckets.py) with the bucket `ckpt`, and its endpoint and
    credentials in this process's environment while the module runs (for the test's own TensorStore client,
    which reads them at each request); pass `server.env` to the trainer's processes."""
    import buckets

    server = buckets.S3Server() if kind == "s3" else buckets.GCSServer()
    server.start()
    server.make_bucket(buckets.BUCKET)
    with pytest.MonkeyPatch.context() as env:
        for k, v in server.env.items():
            env.setenv(k, v)
        yield server
    server.stop()


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server (tests/buckets.py)."""
    yield from _storage_server("s3")


@pytest.fixture(scope="module")
def gcs():
    """gcp-storage-emulator, a GCS server (tests/buckets.py)."""
    yield from _storage_server("gs")


CPU_LOG = os.environ.get("TRAINER_TESTS_CPU_LOG", "")


@pytest.fixture(autouse=bool(CPU_LOG))
def _cpu_log(request):
    """Opt-in (TRAINER_TESTS_CPU_LOG=FILE): each test's wall and CPU seconds, its own and its waited-for
    children's (the trainer processes it ran and their workers; not a SLURM job's, whose tasks are the
    daemons' children), appended as one JSON line. The suite's budget is CPU on 2 cores: the tables of
    benchmarks/results/suite_history.md come from this file."""

    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    c0, t0 = cpu(), time.time()
    yield
    row = {"test": request.node.nodeid, "wall": round(time.time() - t0, 2), "cpu": round(cpu() - c0, 2)}
    row |= {"worker": os.environ.get("PYTEST_XDIST_WORKER", ""), "start": round(t0, 2)}  # the schedule's tail
    with open(CPU_LOG, "a") as f:
        f.write(json.dumps(row) + "\n")


# The longest modules first (wall seconds measured with TRAINER_TESTS_CPU_LOG, suite_history.md in
# benchmarks/results/). Under
# `--dist loadfile` each module runs whole on one worker: a long module handed out last runs alone at the end
# while the other workers sit idle. The SLURM modules mostly wait on daemons and timeouts, so starting them
# early also fills their waits with the others' work. Order within a module is kept. xdist's own reordering
# (by number of tests, the default) is turned off below: under it test_node_loss started at 530 s of 744.
HEAVY_FIRST = (
    "test_integrity",
    "test_resume",
    "test_drill",
    "test_node_loss",
    "test_multihost",
    "test_bucket",  # ~100 s of wall for ~35 CPU-s (servers, waits): early, beside the CPU-heavy modules
    "test_export",
    "test_supervisor",
    "test_llama",
    "test_model",
    "test_config",
    "test_runbook_e2e",
    "test_first_hour",
    "test_slurm_job",
    "test_sharding",
    "test_eval",
    "test_straggler",
    "test_checkpoint",
    "test_layers",
)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's --no-loadscope-reorder
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


def tensorboard(logdir: Path):
    """What TensorBoard reads from one run's log dir (its own files, not its subdirectories' runs)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc
