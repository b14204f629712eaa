"""A private, throw-away SLURM cluster (one node, or several) on 127.0.0.1 for tests.

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

Several nodes (``local_slurm(workdir, nodes=3, node_local="/local_scratch")``):
N slurmds on 127.0.0.1 named n1..nN (own ports; named in /etc/hosts while the
cluster runs), each in its own mount namespace with a private tmpfs at
``node_local`` (this works under gVisor; ``node_local_mode="dir"`` uses a
directory per node instead, found by tasks through ``$LOCAL_SLURM_NODE_LOCAL``).
``lose_node(env, "n2")`` kills a node whole (slurmd, slurmstepds, tasks; its
tmpfs goes with them), ``restore_node`` starts it again, empty. Measured here
(SlurmdTimeout=5): slurmctld marks a lost node DOWN after about
SlurmdTimeout + 2 x MessageTimeout (13 s at MessageTimeout=3, 27 s at 10), and
only then kills the step on it (srun exits 137: "srun: error: Node failure on
n2"); ``lose_node(..., mark_down=True)`` (``scontrol update State=DOWN``) makes
that immediate. A job keeps its allocation only with ``--no-kill``. Killing
srun (or ``scancel`` of the step) before the node is DOWN orphans the step:
it stays, and new steps on its surviving nodes wait with "Requested nodes are
busy" (``srun --overlap`` still starts).

Requires root (slurmd must run as root) and the Debian packages installed by
``.ci/install-slurm.sh``.
"""

from __future__ import annotations

import contextlib
import fcntl
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
    "nodes",
    "node_states",
    "wait_node_state",
    "node_local_path",
    "lose_node",
    "restore_node",
    "NODE_LOCAL_VAR",
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


JOB_ID_BLOCK = 100  # job ids (and so coordinator ports) a cluster may use before the next one's start


def _first_job_id() -> int:
    """The next free block of job ids on this machine, under a lock (clusters start in parallel test workers)."""
    with open("/tmp/local_slurm_job_ids", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        last = int(f.read().strip() or 0)
        first = last + JOB_ID_BLOCK if last + 2 * JOB_ID_BLOCK < 19000 else JOB_ID_BLOCK
        f.seek(0)
        f.truncate()
        f.write(str(first))
    return first


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


def wait_job(job_id: str, env: dict[str, str], timeout: float = 60, *, passing: frozenset[str] = frozenset()) -> str:
    """Wait until the job reaches a terminal state and return it (e.g. COMPLETED).

    Uses ``scontrol show job`` (no accounting database, so no ``sacct``); the
    cluster keeps finished jobs visible for ``MinJobAge`` seconds. States in
    ``passing`` do not end the wait (a job SLURM requeues goes through them).
    Raises TimeoutError with the last seen state otherwise.
    """
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        state = job_state(job_id, env)
        if state in TERMINAL_STATES - passing:
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
    node_ports: dict[str, int] | None = None,
    slurmd_timeout: int = 300,
    message_timeout: int = 10,
) -> None:
    """One node named ``host`` (``node_ports`` None), or one line per node of
    ``node_ports`` (name -> its slurmd port), each with its own spool/pid/log
    file through slurm.conf's ``%n`` (the node name)."""
    plugin_dir = _plugin_dir()
    multi = node_ports is not None
    per_node = "%n" if multi else ""
    suffix = "-%n" if multi else ""  # slurmd-n1.pid, slurmd-n1.log
    names = list(node_ports) if multi else [host]
    if multi:
        node_lines = [
            f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={n} Port={port} CPUs={cpus} State=UNKNOWN"
            for n, port in node_ports.items()
        ]
    else:
        node_lines = [f"NodeName={host} NodeAddr=127.0.0.1 NodeHostname={host} CPUs={cpus} State=UNKNOWN"]
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
        f"SlurmdSpoolDir={workdir / 'spool' / per_node}",
        f"SlurmctldPidFile={workdir / 'run' / 'slurmctld.pid'}",
        f"SlurmdPidFile={workdir / 'run' / f'slurmd{suffix}.pid'}",
        f"SlurmctldLogFile={workdir / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={workdir / 'log' / f'slurmd{suffix}.log'}",
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
        # Job ids unique across the clusters of one machine: a job's services derive ports from its id (the
        # trainer's jax coordinator: 20000 + (id + attempt) % 12768), and two clusters both starting at job 1 would
        # hand two jobs the same port on 127.0.0.1.
        f"FirstJobId={_first_job_id()}",
        "InactiveLimit=0",
        "Waittime=0",
        f"MessageTimeout={message_timeout}",
        f"SlurmdTimeout={slurmd_timeout}",
        "SlurmctldTimeout=60",
        "TmpFS=/tmp",
        "MailProg=/bin/true",
        # nodes / partition
        *node_lines,
        f"PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP",
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


# --------------------------------------------------------------------------
# several nodes on one machine, node-local storage, losing a node
# --------------------------------------------------------------------------

# Set in each slurmd's environment (so also in its slurmstepds'): the node it serves.
NODE_VAR = "LOCAL_SLURM_NODE"
# Exported to every job task when ``node_local`` is set: the task's node-local directory as the task sees it.
NODE_LOCAL_VAR = "LOCAL_SLURM_NODE_LOCAL"
_HOSTS = Path("/etc/hosts")


class _Cluster:
    """What ``lose_node`` / ``restore_node`` / teardown need beyond the env dict (keyed by the marker)."""

    def __init__(self, env, workdir: Path, conf: Path, logdir: Path, nodes: list[str], node_local, mode, spawn):
        self.env = env
        self.workdir = workdir
        self.conf = conf
        self.logdir = logdir
        self.nodes = nodes
        self.node_local = node_local  # the fixed path tasks see (tmpfs mode) or None
        self.mode = mode  # None, "tmpfs" or "dir"
        self.spawn = spawn
        self.slurmd: dict[str, subprocess.Popen] = {}
        self.lost: set[str] = set()

    def proc_name(self, node: str) -> str:
        return "slurmd" if len(self.nodes) == 1 else f"slurmd-{node}"

    def start_slurmd(self, node: str) -> subprocess.Popen:
        args = [_which("slurmd") or "slurmd", "-D", "-f", str(self.conf), "-N", node]
        if self.mode == "tmpfs":
            # A mount namespace of its own with a private tmpfs at the fixed path; slurmstepd and the
            # tasks it forks inherit it. The tmpfs goes away with the last process in the namespace.
            script = 'mount -t tmpfs -o size=256m,mode=1777 tmpfs "$0" && exec "$@"'
            args = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, self.node_local, *args]
        elif self.mode == "dir":
            d = self.dir_of(node)
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        p = self.spawn(self.proc_name(node), args, {NODE_VAR: node})
        self.slurmd[node] = p
        return p

    def dir_of(self, node: str) -> Path:
        return self.workdir / "nodes" / node / "local"


_CLUSTERS: dict[str, _Cluster] = {}


def _cluster(env: dict[str, str]) -> _Cluster:
    try:
        return _CLUSTERS[env[MARKER_VAR]]
    except KeyError:
        raise SlurmClusterError("env does not belong to a running local_slurm cluster") from None


def _tmpfs_namespaces_work(path: str) -> bool:
    """Can we mount a private tmpfs at ``path`` in a new mount namespace (unshare -m)?"""
    if not shutil.which("unshare"):
        return False
    res = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$0"', path],
        capture_output=True,
        timeout=30,
    )
    return res.returncode == 0


@contextlib.contextmanager
def _hosts_locked():
    """Clusters of several xdist workers edit /etc/hosts: a removal's read-then-rewrite must not drop a line
    another cluster appended in between (its nodes would stop resolving while it runs)."""
    with open("/tmp/local_slurm_hosts.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _hosts_add(names: list[str], tag: str) -> str:
    line = f"127.0.0.1 {' '.join(names)}  # {tag}"
    with _hosts_locked(), open(_HOSTS, "a") as f:  # in place: /etc/hosts may be a bind mount
        f.write(line + "\n")
    return line


def _hosts_remove(line: str) -> None:
    with _hosts_locked(), contextlib.suppress(OSError):
        text = _HOSTS.read_text()
        kept = [ln for ln in text.splitlines(keepends=True) if ln.rstrip("\n") != line]
        with open(_HOSTS, "w") as f:
            f.write("".join(kept))


def nodes(env: dict[str, str]) -> list[str]:
    """The cluster's node names (``["n1", "n2", ...]``, or ``[hostname]`` for a one-node cluster)."""
    return env["LOCAL_SLURM_NODES"].split(",")


def node_states(env: dict[str, str]) -> dict[str, str]:
    """``sinfo -N`` per node: name -> state as sinfo prints it (``idle``, ``allocated``, ``down*``, ...)."""
    res = _run(["sinfo", "-h", "-N", "-o", "%N %T"], env, timeout=15, check=False)
    out: dict[str, str] = {}
    for ln in res.stdout.splitlines() if res.returncode == 0 else []:
        parts = ln.split()
        if len(parts) == 2:
            out[parts[0]] = parts[1]
    return out


def wait_node_state(env: dict[str, str], name: str, pred, timeout: float) -> str:
    """Wait until ``pred(state)`` holds for node ``name``'s sinfo state; returns that state."""
    return wait_for(
        lambda: (s := node_states(env).get(name, "")) and pred(s) and s,
        timeout=timeout,
        interval=0.2,
        what=f"node {name} state (last {node_states(env).get(name)!r})",
    )


def node_local_path(env: dict[str, str], name: str) -> Path:
    """Node ``name``'s node-local directory as seen from outside (this process).

    tmpfs mode: ``/proc/<slurmd pid>/root/<node_local>``, the slurmd's view of the filesystem, which
    includes its private tmpfs; dir mode: ``workdir/nodes/<name>/local``. Raises when the node is lost.
    """
    c = _cluster(env)
    if c.mode is None:
        raise SlurmClusterError("cluster was started without node_local")
    if name in c.lost:
        raise SlurmClusterError(f"node {name} is lost")
    if c.mode == "dir":
        return c.dir_of(name)
    return Path(f"/proc/{c.slurmd[name].pid}/root") / c.node_local.lstrip("/")


def _mnt_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _node_pids(c: _Cluster, name: str) -> set[int]:
    """Processes of node ``name``: its slurmd and slurmstepds (NODE_VAR=name), job tasks and clients
    run inside the job there (SLURMD_NODENAME=name), and in tmpfs mode anything in its mount namespace."""
    marker = f"{MARKER_VAR}={c.env[MARKER_VAR]}".encode()
    wanted = {f"{NODE_VAR}={name}".encode(), f"SLURMD_NODENAME={name}".encode()}
    p = c.slurmd.get(name)
    ns = _mnt_ns(p.pid) if p is not None and p.poll() is None and c.mode == "tmpfs" else None
    if ns is not None and ns == _mnt_ns(os.getpid()):
        ns = None
    me = os.getpid()
    found: set[int] = set()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        pid = int(d)
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                penv = set(f.read().split(b"\0"))
        except OSError:
            continue
        if (marker in penv and penv & wanted) or (ns is not None and _mnt_ns(pid) == ns):
            if not _is_zombie(pid):
                found.add(pid)
    return found


def lose_node(env: dict[str, str], name: str, *, mark_down: bool = False, timeout: float = 10.0) -> float:
    """Node ``name`` dies whole: its slurmd, slurmstepds and job tasks are SIGSTOPped together (nobody on
    the node reacts to the others' deaths), then SIGKILLed; its node-local storage goes with them (the
    tmpfs with its namespace; in dir mode the directory is deleted).

    With ``mark_down`` also ``scontrol update NodeName=name State=DOWN Reason=lost`` (what an operator or
    a health check does); otherwise slurmctld notices by itself after ``SlurmdTimeout`` (+ one ping).
    Returns the seconds the kill took. The TCP connections of the dead processes are closed by the
    kernel (FIN/RST), unlike a powered-off node's, which just go silent.
    """
    c = _cluster(env)
    if name not in c.nodes:
        raise ValueError(f"unknown node {name!r} (nodes: {c.nodes})")
    t0 = time.monotonic()
    deadline = t0 + timeout
    while True:
        pids = _node_pids(c, name)
        if not pids:
            break
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        if time.monotonic() > deadline:
            raise SlurmClusterError(f"node {name}: processes {sorted(pids)} survive SIGKILL")
        time.sleep(0.05)
    p = c.slurmd.get(name)
    if p is not None:
        p.wait(timeout)
    c.lost.add(name)
    if c.mode == "dir":
        shutil.rmtree(c.dir_of(name), ignore_errors=True)
    took = time.monotonic() - t0
    if mark_down:
        _run(["scontrol", "update", f"NodeName={name}", "State=DOWN", "Reason=lost"], env, timeout=15)
    return took


def freeze_node(env: dict[str, str], name: str) -> set[int]:
    """Node ``name`` goes silent without closing anything (power loss, a kernel hang, its NIC gone): its slurmd,
    slurmstepds and job tasks are SIGSTOPped together; their connections stay open and their peers hear
    nothing. Returns the stopped pids; ``lose_node`` ends them."""
    c = _cluster(env)
    pids = _node_pids(c, name)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGSTOP)
    return pids


def restore_node(env: dict[str, str], name: str, timeout: float = 60.0) -> float:
    """Start node ``name``'s slurmd again (fresh, empty node-local storage) and wait until it is back in
    service: responding and not down/drained (``idle``, or ``mixed``/``allocated`` while a job still holds
    it), resuming it (``scontrol update State=RESUME``) if it registered but stays down. Returns seconds."""
    c = _cluster(env)
    if name not in c.lost:
        raise SlurmClusterError(f"node {name} is not lost")
    t0 = time.monotonic()
    p = c.start_slurmd(name)
    c.lost.discard(name)
    deadline = t0 + timeout
    resumed = False
    while True:
        state = node_states(env).get(name, "")
        if state in ("idle", "mixed", "allocated", "completing"):
            return time.monotonic() - t0
        if p.poll() is not None:
            raise SlurmClusterError(f"slurmd for {name} exited with {p.returncode}")
        # registered (no '*': it answers) but still down / drained: return it to service
        if not resumed and state and not state.endswith("*") and ("down" in state or "drain" in state):
            _run(["scontrol", "update", f"NodeName={name}", "State=RESUME"], env, timeout=15, check=False)
            resumed = True
        if time.monotonic() > deadline:
            raise SlurmClusterError(f"node {name} not idle {timeout}s after restart (state {state!r})")
        time.sleep(0.2)


# --------------------------------------------------------------------------
# the cluster
# --------------------------------------------------------------------------


@contextlib.contextmanager
def local_slurm(
    workdir: Path,
    *,
    nodes: int = 1,
    node_local: str | None = None,
    node_local_mode: str = "auto",
    node_prefix: str = "n",
    cpus: int = 8,
    startup_timeout: float = 60.0,
    cluster_name: str = "localtest",
    cred_expire: int = 10,
    slurmd_timeout: int | None = None,
    message_timeout: int = 10,
) -> Iterator[dict[str, str]]:
    """Start a private slurmctld + slurmd(s) (+ munged) on 127.0.0.1.

    Yields a copy of ``os.environ`` with ``SLURM_CONF`` (and a marker variable
    used for cleanup) set; pass it as ``env=`` to sbatch/srun/squeue/...
    Jobs submitted with it inherit it (sbatch's default ``--export=ALL``), so
    ``srun`` inside batch scripts finds the same cluster.

    ``cred_expire`` (seconds, >= 5) is the step-credential lifetime; SLURM also
    holds a requeued job for that long (plus up to ~1 s scheduling delay)
    before it runs again.  ``env["LOCAL_SLURM_STARTUP_SECONDS"]`` records how
    long startup took.

    ``nodes=1`` (default): one slurmd whose node is named after this host.
    ``nodes=N>1``: N slurmd daemons on 127.0.0.1, nodes ``{node_prefix}1..N``
    (``n1, n2, ...``), each with its own port and spool/pid/log files, named in
    /etc/hosts while the cluster runs; ``SlurmdTimeout`` defaults to 5 s
    (300 s for one node) so a lost node is noticed quickly.
    ``env["LOCAL_SLURM_NODES"]`` lists the node names (also ``nodes(env)``).

    ``node_local`` (a path such as ``"/local_scratch"``): storage that lives and
    dies with its node. ``node_local_mode="tmpfs"``: each slurmd runs in its own
    mount namespace with a private tmpfs at that one path, so every task sees
    its own node's files there; ``"dir"``: a directory per node under
    ``workdir/nodes/<name>/local``; ``"auto"``: tmpfs when the namespace mount
    works here, else dir. Either way every task gets the path in
    ``$LOCAL_SLURM_NODE_LOCAL`` (a TaskProlog exports it) and
    ``env["LOCAL_SLURM_NODE_LOCAL_MODE"]`` says which mode is in use;
    ``node_local_path(env, name)`` reaches a node's directory from outside.
    """
    if os.geteuid() != 0:
        raise SlurmClusterError("local_slurm needs root (slurmd runs as root)")
    if not slurm_available():
        missing = [b for b in SLURM_BINARIES if not _which(b)]
        raise SlurmClusterError(f"SLURM binaries missing: {missing}; run .ci/install-slurm.sh")
    if nodes < 1:
        raise ValueError("nodes must be >= 1")
    if node_local_mode not in ("auto", "tmpfs", "dir"):
        raise ValueError(f"node_local_mode must be auto, tmpfs or dir, not {node_local_mode!r}")

    workdir = Path(workdir).resolve()
    for sub in ("state", "spool", "log", "run", "munge"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    logdir = workdir / "log"

    host = socket.gethostname().split(".")[0]
    marker = uuid.uuid4().hex
    ctld_port, slurmd_port = _free_ports(2)
    multi = nodes > 1
    names = [f"{node_prefix}{i}" for i in range(1, nodes + 1)] if multi else [host]
    node_ports = dict(zip(names, _free_ports(nodes + 2)[2:], strict=True)) if multi else None
    for n in names if multi else []:
        (workdir / "spool" / n).mkdir(exist_ok=True)

    mode = None
    if node_local is not None:
        if not os.path.isabs(node_local):
            raise ValueError("node_local must be an absolute path")
        # Made once and never removed: another cluster (another xdist worker) may be mounting its private
        # tmpfs over the same path, and rmdir of a mount point here detaches those mounts in every namespace
        # (its nodes would then see this disk's empty directory: seen in CI as "fast tier on the same disk").
        os.makedirs(node_local, exist_ok=True)
        mode = node_local_mode
        if mode == "auto":
            mode = "tmpfs" if _tmpfs_namespaces_work(node_local) else "dir"

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
        node_ports=node_ports,
        slurmd_timeout=slurmd_timeout if slurmd_timeout is not None else (5 if multi else 300),
        message_timeout=message_timeout,
    )
    if mode is not None:
        prolog = workdir / "task_prolog.sh"
        where = node_local if mode == "tmpfs" else f"{workdir / 'nodes'}/$SLURMD_NODENAME/local"
        prolog.write_text(f'#!/bin/sh\necho "export {NODE_LOCAL_VAR}={where}"\n')
        prolog.chmod(0o755)
        with open(conf, "a") as f:
            f.write(f"TaskProlog={prolog}\n")

    env = dict(os.environ)
    # Don't let a surrounding real SLURM job/allocation leak into ours.
    for k in list(env):
        if k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")):
            del env[k]
    env["SLURM_CONF"] = str(conf)
    env[MARKER_VAR] = marker
    sbin = ":".join(d for d in _SBIN_DIRS if os.path.isdir(d))
    env["PATH"] = env.get("PATH", "") + (":" + sbin if sbin else "")
    env["LOCAL_SLURM_NODES"] = ",".join(names)
    if mode is not None:
        env["LOCAL_SLURM_NODE_LOCAL_MODE"] = mode

    procs: list[tuple[str, subprocess.Popen, Path]] = []

    def spawn(name: str, args: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        out = logdir / f"{name}.stdout"
        with open(out, "ab") as fh:
            p = subprocess.Popen(
                args,
                env=dict(env, **(extra_env or {})),
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

    cluster = _Cluster(env, workdir, conf, logdir, names, node_local, mode, spawn)
    hosts_line = None
    t0 = time.monotonic()
    try:
        if multi:
            # Node names must resolve, as a real cluster's DNS makes them.
            hosts_line = _hosts_add(names, f"local_slurm {marker}")
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
        for n in names:
            cluster.start_slurmd(n)
        _CLUSTERS[marker] = cluster

        deadline = t0 + startup_timeout
        state: dict[str, str] = {}
        while True:
            state = node_states(env)
            if sorted(state) == sorted(names) and all(s == "idle" for s in state.values()):
                break
            for name, p, _ in procs:
                if p.poll() is not None:
                    raise failure(f"{name} exited with {p.returncode} during startup")
            if time.monotonic() > deadline:
                raise failure(f"nodes not idle after {startup_timeout}s (sinfo: {state!r})")
            time.sleep(0.25)
        env["LOCAL_SLURM_STARTUP_SECONDS"] = f"{time.monotonic() - t0:.2f}"

        yield env
    finally:
        _CLUSTERS.pop(marker, None)
        _teardown(env, procs, marker)
        shutil.rmtree(sockdir, ignore_errors=True)
        if hosts_line is not None:
            _hosts_remove(hosts_line)


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
    # A node lost and restored has had more than one slurmd: the live one counts.
    by_name: dict[str, subprocess.Popen] = {}
    for name, p, _ in procs:
        if name not in by_name or p.poll() is None:
            by_name[name] = p
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
    # slurmd(s) first, then the controller, then munge; none of their state is
    # worth waiting for, so SIGKILL after 2 s (slurmctld otherwise lingers
    # for ~5 s retrying messages to a dead step).
    slurmds = [n for n in by_name if n == "slurmd" or n.startswith("slurmd-")]
    for name in slurmds:  # all told at once, then waited for one by one
        with contextlib.suppress(ProcessLookupError):
            by_name[name].terminate()
    for name in (*slurmds, "slurmctld", "munged"):
        p = by_name.get(name)
        if p is not None:
            with contextlib.suppress(Exception):
                _stop(p, timeout=2.0)
    # Final sweep for anything started meanwhile.
    left = _kill_marked(marker)
    if left:
        warnings.warn(f"local_slurm: could not kill processes {left}", RuntimeWarning, stacklevel=3)
