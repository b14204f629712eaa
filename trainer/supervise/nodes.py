"""The nodes of a SLURM allocation, as the launcher sees them: what srun reports about their tasks, which
ones SLURM reports failed, which ones this run blamed (kept in RUN_DIR/suspect_nodes.json, so a requeued
job's new supervisor avoids them too), and which ones the next step runs on. Never imports jax.
"""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

from trainer.config import ConfigError
from trainer.store import rundir

# `srun: error: node7: task 1: Killed` / `srun: error: node7: tasks 0-3: Exited with exit code 13`
TASK_ERROR = re.compile(r"srun: error: (\S+): tasks? [\d,\-]+: (.+)$")
# SLURM marked a node of the step DOWN and killed the step: `srun: error: Node failure on node7`. The tasks
# it killed on the other nodes are reported after (or before) it: consequences, not causes.
NODE_FAILURE = re.compile(r"srun: error: Node failure on (\S+)")
_SIGNALS = {
    "Killed": -signal.SIGKILL,
    "Terminated": -signal.SIGTERM,
    "Segmentation fault": -signal.SIGSEGV,
    "Aborted": -signal.SIGABRT,
    "Bus error": -signal.SIGBUS,
}


def task_error_code(status: str) -> int | None:
    """srun's words for how a task ended, as an exit code (negative: the signal)."""
    m = re.match(r"Exited with exit code (\d+)", status)
    return int(m.group(1)) if m else _SIGNALS.get(status.split(" (")[0].strip())


def plan_nodes(
    allocated: list[str], suspects: set[str], *, processes: int, per_node: int, min_processes: int
) -> tuple[list[str], int]:
    """Nodes and process count for the next step. Spares replace suspect nodes so the mesh keeps its
    shape; with too few healthy nodes, shrink to a divisor of `processes` if min_processes allows;
    otherwise retry on suspect nodes too (a lost process is not a lost node). A shrunk group keeps the
    global batch AND each device's batch: its workers (trainer.train.worker.elastic_microbatches) raise
    train.microbatches by processes / shrunk count, so memory per device does not grow."""
    need = processes // per_node
    healthy = [n for n in allocated if n not in suspects]
    if len(healthy) >= need:
        return healthy[:need], processes
    fits = [
        p for p in range(processes, 0, -1) if processes % p == 0 and p % per_node == 0 and p // per_node <= len(healthy)
    ]
    if min_processes and fits and fits[0] >= min_processes:
        return healthy[: fits[0] // per_node], fits[0]
    return (healthy + [n for n in allocated if n in suspects])[:need], processes


def read_suspects(path: Path) -> dict[str, dict]:
    """RUN_DIR/suspect_nodes.json's nodes ({} when absent or unreadable: a damaged file must not stop a run)."""
    try:
        nodes = (rundir.read_json(path) or {}).get("nodes", {})
    except (ConfigError, OSError, AttributeError):
        return {}
    return {str(n): dict(v) for n, v in nodes.items() if isinstance(v, dict)} if isinstance(nodes, dict) else {}


def write_suspects(path: Path, suspects: Mapping[str, dict]) -> None:
    rundir.write_json(path, {"nodes": dict(suspects)})


def hostnames(nodelist: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    return out.stdout.split() or [nodelist]


def down_nodes(nodes: list[str]) -> dict[str, str]:
    """Nodes SLURM itself reports as failed (down, drained, failing or not responding) -> their state."""
    if not nodes:
        return {}
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %t"], capture_output=True, text=True, timeout=30
    ).stdout
    bad = {"down", "drain", "drng", "fail", "failg", "npc", "no_respond"}
    out_nodes: dict[str, str] = {}
    for ln in out.splitlines():
        parts = ln.split()
        # A trailing "*" means not responding; other suffixes only qualify the state.
        if len(parts) == 2 and (parts[1].endswith("*") or parts[1].rstrip("~#!%$@^-") in bad):
            out_nodes[parts[0]] = parts[1]
    return out_nodes


def srun_command(argv: list[str], *, nodes: list[str], processes: int, per_node: int, launch_id: str) -> list[str]:
    return [
        "srun",
        f"--nodes={len(nodes)}",
        f"--ntasks={processes}",
        f"--ntasks-per-node={per_node}",
        f"--nodelist={','.join(nodes)}",
        "--kill-on-bad-exit=1",
        "--overlap",  # see trainer.supervise.srun_group.SrunGroup
        "--label",
        f"--job-name={launch_id}",
        *argv,
    ]
