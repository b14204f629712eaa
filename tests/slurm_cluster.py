"""A private, throw-away single-node SLURM cluster on 127.0.0.1 for tests.

Not a test module: import it from tests, e.g.::

    from slurm_cluster import local_slurm, slurm_available, sbatch, wait_job

    with local_slurm(tmp_path) as env:
        job = sbatch(script_path, env)
        assert wait_job(job, env, timeout=60) == "COMPLETED"

What ``local_slurm`` does:

* creates its own munge key and runs ``munged`` in the foreground with its own
  socket / pid / log / seed files (``--force`` lets root run it from a
  directory munged would otherwise reject; the socket lives in a short
  ``/tmp/lslurm-*`` directory because of the 108-byte unix-socket limit);
* writes a private ``slurm.conf`` (free TCP ports picked at runtime, all state,
  spool, log and pid files under ``workdir``, no cgroups, no accounting,
  ``SlurmdParameters=config_overrides`` so the node may claim more CPUs than
  the machine has) and points every client at it through ``SLURM_CONF``;
* starts ``slurmctld -D`` and ``slurmd -D`` as child processes, waits (bounded)
  until ``sinfo`` reports the node idle, and yields an environment dict for
  running ``sbatch``/``srun``/``squeue``/``scontrol``;
* on exit cancels all jobs, stops the daemons and kills every leftover process
  that carries this cluster's marker environment variable (slurmstepd and job
  tasks are re-parented to init, so they are found through ``/proc``).

Requires root (slurmd must run as root) and the Debian packages installed by
``.ci/install-slurm.sh``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "SlurmClusterError",
    "local_slurm",
    "slurm_available",
    "sbatch",
    "job_info",
    "job_state",
    "wait_job",
    "wait_for",
    "cluster_pids",
    "TERMINAL_STATES",
]

SLURM_BINARIES = (
    "slurmctld",
    "slurmd",
    "slurmstepd",
    "sbatch",
    "srun",
    "squeue",
    "sinfo",
    "scontrol",
    "scancel",
    "munged",
)

# Job states after which a job will not run again by itself.
TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "SPECIAL_EXIT",
    }
)

# Name of the environment variable that tags every process of one cluster.
MARKER_VAR = "LOCAL_SLURM_CLUSTER_ID"

_SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")


class SlurmClusterError(RuntimeError):
    """The private cluster could not be started (message includes log tails)."""


def _which(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in _SBIN_DIRS:
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return None


def slurm_available() -> bool:
    """True when the SLURM daemons, clients and munged are installed."""
    return all(_which(b) for b in SLURM_BINARIES)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = _free_port()
        if p not in ports:
            ports.append(p)
    return ports


def _plugin_dir() -> str | None:
    candidates = [
        "/usr/lib/x86_64-linux-gnu/slurm-wlm",
        "/usr/lib/aarch64-linux-gnu/slurm-wlm",
        "/usr/lib/slurm-wlm",
        "/usr/lib64/slurm",
        "/usr/lib/slurm",
    ]
    for c in candidates:
        if os.path.exists(os.path.join(c, "proctrack_linuxproc.so")):
            return c
    return None


def _tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(lines[-n:])


def _run(
    args: list[str], env: dict[str, str], timeout: float = 30, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, check=check)


# --------------------------------------------------------------------------
# job helpers
# --------------------------------------------------------------------------


def sbatch(script: str | os.PathLike[str], env: dict[str, str], *args: str, timeout: float = 30) -> str:
    """Submit ``script`` (a path) with ``sbatch --parsable``; returns the job id."""
    out = _run(["sbatch", "--parsable", *args, str(script)], env, timeout=timeout)
    return out.stdout.strip().split(";")[0]


def job_info(job_id: str, env: dict[str, str]) -> dict[str, str] | None:
    """``scontrol show job -o`` as a dict, or None when the job is unknown."""
    res = _run(["scontrol", "show", "job", "-o", str(job_id)], env, check=False)
    if res.returncode != 0 or "JobId=" not in res.stdout:
        return None
    info: dict[str, str] = {}
    # Values never contain spaces except Command=/WorkDir=/... paths, which
    # we do not need to parse exactly; split on spaces and '='.
    for tok in res.stdout.strip().split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            info.setdefault(k, v)
    return info


def job_state(job_id: str, env: dict[str, str]) -> str | None:
    info = job_info(job_id, env)
    return None if info is None else info.get("JobState")


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition"):
    """Poll ``predicate()`` until it returns a truthy value; returns it."""
    deadline = time.monotonic() + timeout
    while True:
        val = predicate()
        if val:
            return val
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_job(job_id: str, env: dict[str, str], timeout: float = 60) -> str:
    """Wait until the job reaches a terminal state and return it (e.g. COMPLETED).

    Uses ``scontrol show job`` (no accounting database, so no ``sacct``); the
    cluster keeps finished jobs visible for ``MinJobAge`` seconds.
    Raises TimeoutError with the last seen state otherwise.
    """
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        state = job_state(job_id, env)
        if state in TERMINAL_STATES:
            return state
        time.sleep(0.25)
    raise TimeoutError(f"job {job_id} not finished after {timeout}s (last state {state!r})")


# --------------------------------------------------------------------------
# the cluster
# --------------------------------------------------------------------------


def _write_conf(
    conf: Path,
    *,
    workdir: Path,
    host: str,
    ctld_port: int,
    slurmd_port: int,
    munge_socket: Path,
    cpus: int,
    cluster_name: str,
    cred_expire: int,
) -> None:
    plugin_dir = _plugin_dir()
    lines = [
        f"ClusterName={cluster_name}",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        # auth: our private munged
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire also sets how long a requeued job waits before it may
        # start again (default 120 s).
        f"AuthInfo=socket={munge_socket},cred_expire={cred_expire}",
        # files
        f"StateSaveLocation={workdir / 'state'}",
        f"SlurmdSpoolDir={workdir / 'spool'}",
        f"SlurmctldPidFile={workdir / 'run' / 'slurmctld.pid'}",
        f"SlurmdPidFile={workdir / 'run' / 'slurmd.pid'}",
        f"SlurmctldLogFile={workdir / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={workdir / 'log' / 'slurmd.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # no cgroups anywhere (containers / gVisor)
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        # no accounting
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        # scheduling
        "SchedulerType=sched/builtin",
        # The main scheduling loop also runs on submit/finish events; the
        # periodic pass (default 60 s) is what starts a requeued job once its
        # cred_expire hold-off has passed.
        "SchedulerParameters=sched_interval=1",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "JobRequeue=1",
        "KillWait=2",
        "MinJobAge=3600",
        "InactiveLimit=0",
        "Waittime=0",
        "MessageTimeout=10",
        "SlurmdTimeout=300",
        "SlurmctldTimeout=60",
        "TmpFS=/tmp",
        "MailProg=/bin/true",
        # nodes / partition
        f"NodeName={host} NodeAddr=127.0.0.1 NodeHostname={host} CPUs={cpus} State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
    ]
    if plugin_dir:
        lines.insert(0, f"PluginDir={plugin_dir}")
    lines = [ln for ln in lines if not ln.endswith("=")]
    conf.write_text("\n".join(lines) + "\n")


def _procs_with_marker(marker: str) -> list[int]:
    """PIDs (other than ours) whose environment contains MARKER_VAR=marker."""
    needle = f"{MARKER_VAR}={marker}".encode()
    me = os.getpid()
    pids: list[int] = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        pid = int(d)
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            pids.append(pid)
    return pids


def cluster_pids(env: dict[str, str]) -> list[int]:
    """Live processes belonging to the cluster that yielded ``env`` (daemons,
    slurmstepd, job tasks, clients run with ``env``).  Empty after exit."""
    return [p for p in _procs_with_marker(env[MARKER_VAR]) if not _is_zombie(p)]


def _kill_marked(marker: str, timeout: float = 10.0, exclude: frozenset[int] = frozenset()) -> list[int]:
    """SIGKILL every process carrying the marker until none is left.

    Returns the pids that were still alive at the end (normally empty)."""
    deadline = time.monotonic() + timeout
    while True:
        # zombies of our own children still show up; reap what we can
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        alive = [
            p for p in _procs_with_marker(marker) if p not in exclude and _ppid(p) not in exclude and not _is_zombie(p)
        ]
        if not alive or time.monotonic() > deadline:
            return alive
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _stop(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout)


@contextlib.contextmanager
def local_slurm(
    workdir: Path,
    *,
    cpus: int = 8,
    startup_timeout: float = 60.0,
    cluster_name: str = "localtest",
    cred_expire: int = 10,
) -> Iterator[dict[str, str]]:
    """Start a private slurmctld + slurmd (+ munged) on 127.0.0.1.

    Yields a copy of ``os.environ`` with ``SLURM_CONF`` (and a marker variable
    used for cleanup) set; pass it as ``env=`` to sbatch/srun/squeue/...
    Jobs submitted with it inherit it (sbatch's default ``--export=ALL``), so
    ``srun`` inside batch scripts finds the same cluster.

    ``cred_expire`` (seconds, >= 5) is the step-credential lifetime; SLURM also
    holds a requeued job for that long (plus up to ~1 s scheduling delay)
    before it runs again.  ``env["LOCAL_SLURM_STARTUP_SECONDS"]`` records how
    long startup took.
    """
    if os.geteuid() != 0:
        raise SlurmClusterError("local_slurm needs root (slurmd runs as root)")
    if not slurm_available():
        missing = [b for b in SLURM_BINARIES if not _which(b)]
        raise SlurmClusterError(f"SLURM binaries missing: {missing}; run .ci/install-slurm.sh")

    workdir = Path(workdir).resolve()
    for sub in ("state", "spool", "log", "run", "munge"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    logdir = workdir / "log"

    host = socket.gethostname().split(".")[0]
    marker = uuid.uuid4().hex
    ctld_port, slurmd_port = _free_ports(2)

    # munge: key + state under workdir; socket in a short world-traversable
    # directory (munged wants "execute for all" on the socket's directories,
    # --force downgrades that to a warning, and unix socket paths are limited
    # to 108 bytes).
    sockdir = Path(tempfile.mkdtemp(prefix="lslurm-", dir="/tmp"))
    os.chmod(sockdir, 0o755)
    munge_socket = sockdir / "munge.sock"
    key = workdir / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    os.chmod(workdir / "munge", 0o700)

    conf = workdir / "slurm.conf"
    _write_conf(
        conf,
        workdir=workdir,
        host=host,
        ctld_port=ctld_port,
        slurmd_port=slurmd_port,
        munge_socket=munge_socket,
        cpus=cpus,
        cluster_name=cluster_name,
        cred_expire=cred_expire,
    )

    env = dict(os.environ)
    # Don't let a surrounding real SLURM job/allocation leak into ours.
    for k in list(env):
        if k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")):
            del env[k]
    env["SLURM_CONF"] = str(conf)
    env[MARKER_VAR] = marker
    sbin = ":".join(d for d in _SBIN_DIRS if os.path.isdir(d))
    env["PATH"] = env.get("PATH", "") + (":" + sbin if sbin else "")

    procs: list[tuple[str, subprocess.Popen, Path]] = []

    def spawn(name: str, args: list[str]) -> subprocess.Popen:
        out = logdir / f"{name}.stdout"
        with open(out, "wb") as fh:
            p = subprocess.Popen(
                args,
                env=env,
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        procs.append((name, p, out))
        return p

    def failure(msg: str) -> SlurmClusterError:
        parts = [msg, f"workdir: {workdir}", f"slurm.conf:\n{conf.read_text() if conf.exists() else ''}"]
        for f in sorted(logdir.iterdir()) + [workdir / "munge" / "munged.log"]:
            if f.exists() and f.stat().st_size:
                parts.append(f"--- {f.name} (tail) ---\n{_tail(f)}")
        for name, p, _ in procs:
            parts.append(f"{name}: returncode={p.poll()}")
        return SlurmClusterError("\n".join(parts))

    def sinfo_state() -> str:
        res = _run(["sinfo", "-h", "-N", "-o", "%N %T"], env, timeout=15, check=False)
        return res.stdout.strip() if res.returncode == 0 else ""

    t0 = time.monotonic()
    try:
        spawn(
            "munged",
            [
                _which("munged") or "munged",
                "--foreground",
                "--force",
                f"--socket={munge_socket}",
                f"--key-file={key}",
                f"--pid-file={workdir / 'munge' / 'munged.pid'}",
                f"--log-file={workdir / 'munge' / 'munged.log'}",
                f"--seed-file={workdir / 'munge' / 'munged.seed'}",
                "--num-threads=2",
            ],
        )
        _wait_or_fail(lambda: munge_socket.exists(), 15, procs, failure, "munged socket")

        spawn("slurmctld", [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(conf)])
        spawn("slurmd", [_which("slurmd") or "slurmd", "-D", "-f", str(conf), "-N", host])

        deadline = t0 + startup_timeout
        state = ""
        while True:
            state = sinfo_state()
            if state.split()[-1:] == ["idle"]:
                break
            for name, p, _ in procs:
                if p.poll() is not None:
                    raise failure(f"{name} exited with {p.returncode} during startup")
            if time.monotonic() > deadline:
                raise failure(f"node not idle after {startup_timeout}s (sinfo: {state!r})")
            time.sleep(0.25)
        env["LOCAL_SLURM_STARTUP_SECONDS"] = f"{time.monotonic() - t0:.2f}"

        yield env
    finally:
        _teardown(env, procs, marker)
        shutil.rmtree(sockdir, ignore_errors=True)


def _wait_or_fail(pred, timeout, procs, failure, what) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        for name, p, _ in procs:
            if p.poll() is not None:
                raise failure(f"{name} exited with {p.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise failure(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def _teardown(env: dict[str, str], procs, marker: str) -> None:
    by_name = {name: p for name, p, _ in procs}
    ctld = by_name.get("slurmctld")
    if ctld is not None and ctld.poll() is None:
        # Be nice first: cancel every job and give steps a moment to end
        # (whatever is still running afterwards is SIGKILLed below).
        with contextlib.suppress(Exception):
            user = pwd.getpwuid(os.geteuid()).pw_name
            _run(["scancel", f"--user={user}"], env, timeout=10, check=False)

            def no_running() -> bool:
                res = _run(["squeue", "-h", "-t", "R,CG,S", "-o", "%i"], env, timeout=10, check=False)
                return res.returncode == 0 and not res.stdout.strip()

            with contextlib.suppress(TimeoutError):
                wait_for(no_running, timeout=2, what="jobs to finish")
    # Job processes (slurmstepd, tasks, srun, batch shells) are daemonized /
    # re-parented to init: find them by the marker variable they all inherit
    # and SIGKILL them while the daemons still run (slurmd's own shutdown
    # otherwise waits for its step-handling threads).  The daemons and their
    # direct children (slurmctld's slurmscriptd) are spared for now.
    daemons = frozenset(p.pid for p in by_name.values())
    _kill_marked(marker, exclude=daemons)
    # slurmd first, then the controller, then munge; none of their state is
    # worth waiting for, so SIGKILL after 2 s (slurmctld otherwise lingers
    # for ~5 s retrying messages to a dead step).
    for name in ("slurmd", "slurmctld", "munged"):
        p = by_name.get(name)
        if p is not None:
            with contextlib.suppress(Exception):
                _stop(p, timeout=2.0)
    # Final sweep for anything started meanwhile.
    left = _kill_marked(marker)
    if left:
        warnings.warn(f"local_slurm: could not kill processes {left}", RuntimeWarning, stacklevel=3)
