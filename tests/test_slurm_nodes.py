"""A private three-node SLURM cluster on one machine (tests/slurm_cluster.py, nodes=3): every node has
node-local storage of its own at one path, and a node can be lost whole (its slurmd, slurmstepds, job
tasks and node-local files at once), as a real cluster loses a machine. Groundwork for the supervisor's
"a whole node lost" tests; no training here.

Skipped without SLURM binaries or root, except under CI (where it must run: .ci/run installs SLURM).
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from slurm_cluster import (
    MARKER_VAR,
    NODE_LOCAL_VAR,
    lose_node,
    node_local_path,
    node_states,
    nodes,
    restore_node,
    wait_for,
    wait_node_state,
)
from slurm_cluster import local_slurm as _local_slurm
from test_slurm_job import _require_slurm

LOCAL = "/local_scratch"
SLURMD_TIMEOUT, MESSAGE_TIMEOUT = 5, 3  # SLURM notices a lost node after about SlurmdTimeout + 2 x MessageTimeout


def local_slurm(tmp_path, mode: str = "auto"):
    return _local_slurm(
        tmp_path / "slurm",
        nodes=3,
        node_local=LOCAL,
        node_local_mode=mode,
        cpus=2,
        slurmd_timeout=SLURMD_TIMEOUT,
        message_timeout=MESSAGE_TIMEOUT,
    )


def srun(env, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["srun", *args], env=env, capture_output=True, text=True, timeout=timeout)


# Each task writes its node's name into its node-local directory, then lists that directory.
WRITE_AND_LIST = f'touch "${NODE_LOCAL_VAR}/from.$SLURMD_NODENAME"; echo "$SLURMD_NODENAME $(ls ${NODE_LOCAL_VAR})"'


# "auto" is a private tmpfs per node where mount namespaces work (they do under gVisor), else "dir".
@pytest.mark.slow  # a private SLURM cluster
@pytest.mark.parametrize("mode", ["auto", "dir"])
def test_three_nodes_each_with_its_own_node_local_storage(tmp_path, mode):
    _require_slurm()
    with local_slurm(tmp_path, mode) as env:
        print(
            f"3-node cluster up in {env['LOCAL_SLURM_STARTUP_SECONDS']} s, node-local storage: "
            f"{env['LOCAL_SLURM_NODE_LOCAL_MODE']}"
        )
        assert nodes(env) == ["n1", "n2", "n3"]
        assert node_states(env) == {"n1": "idle", "n2": "idle", "n3": "idle"}
        hosts = open("/etc/hosts").read().splitlines()
        ours = f"127.0.0.1 n1 n2 n3  # local_slurm {env[MARKER_VAR]}"  # other clusters may add their own
        assert ours in hosts

        res = srun(env, "-N3", "-n3", "-l", "sh", "-c", f"echo ${NODE_LOCAL_VAR}; {WRITE_AND_LIST}")
        assert res.returncode == 0, res.stderr
        lines = sorted(res.stdout.splitlines())
        if env["LOCAL_SLURM_NODE_LOCAL_MODE"] == "tmpfs":  # one path, a different tmpfs behind it on each node
            assert [ln for ln in lines if "/" in ln] == [f"{i}: {LOCAL}" for i in range(3)]
        # one task per node, in node order, and each sees only the file it wrote
        assert [ln for ln in lines if "/" not in ln] == ["0: n1 from.n1", "1: n2 from.n2", "2: n3 from.n3"]
        for n in nodes(env):  # the same files from outside
            assert sorted(p.name for p in node_local_path(env, n).iterdir()) == [f"from.{n}"]
        (node_local_path(env, "n2") / "from.outside").write_text("hello")
        res = srun(env, "-w", "n2", "-N1", "sh", "-c", f'cat "${NODE_LOCAL_VAR}/from.outside"')
        assert res.stdout == "hello", res.stderr
        if env["LOCAL_SLURM_NODE_LOCAL_MODE"] == "tmpfs":
            assert not any(p.name.startswith("from.") for p in os.scandir(LOCAL))  # the host's own dir
    after = open("/etc/hosts").read().splitlines()  # exactly our line went again; the machine's own stay
    assert ours not in after and all(ln in after for ln in hosts if "# local_slurm" not in ln)


@pytest.mark.slow  # a private SLURM cluster
def test_lost_node_goes_down_and_a_new_step_runs_on_the_others(tmp_path):
    _require_slurm()
    t_all = time.monotonic()
    with local_slurm(tmp_path) as env:
        # --no-kill: a failed node does not end the allocation (as launch/slurm.sbatch asks)
        alloc = subprocess.run(
            ["salloc", "-N3", "--no-kill", "--no-shell"], env=env, capture_output=True, text=True, timeout=30
        )
        assert alloc.returncode == 0, alloc.stderr
        job = alloc.stderr.split("Granted job allocation")[1].split()[0]
        out = tmp_path / "step0.out"
        with open(out, "w") as fh:
            step0 = subprocess.Popen(
                ["srun", f"--jobid={job}", "-N3", "-n3", "-l", "sh", "-c", f"{WRITE_AND_LIST}; exec sleep 600"],
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
            )
        wait_for(lambda: out.read_text().count("from.") == 3, timeout=30, what="the three tasks")
        n2_local = node_local_path(env, "n2")
        assert (n2_local / "from.n2").exists()

        t0 = time.monotonic()
        lose_node(env, "n2")  # no scontrol: SLURM must notice by itself
        assert not n2_local.exists()  # the node's tmpfs (or dir) went with it
        with pytest.raises(Exception, match="lost"):
            node_local_path(env, "n2")
        # "down*": marked DOWN and not responding; before that "mixed*" (allocated, not responding).
        bound = 2 * (SLURMD_TIMEOUT + 2 * MESSAGE_TIMEOUT) + 15
        wait_node_state(env, "n2", lambda s: s.startswith("down"), timeout=bound)
        noticed = time.monotonic() - t0
        # On the node failure slurmctld kills the step (the tasks on n1 and n3 too) and srun exits.
        rc = step0.wait(timeout=30)
        srun_done = time.monotonic() - t0
        log = out.read_text()
        assert rc != 0 and "Node failure on n2" in log, log
        assert (
            subprocess.run(
                ["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True, timeout=15
            ).stdout.strip()
            == "RUNNING"
        )  # the allocation lives on

        # A new step on the two remaining nodes of the same allocation starts at once.
        t1 = time.monotonic()
        res = srun(env, f"--jobid={job}", "-N2", "-n2", "-w", "n1,n3", "-l", "sh", "-c", WRITE_AND_LIST, timeout=60)
        new_step = time.monotonic() - t1
        assert res.returncode == 0, res.stderr
        assert sorted(res.stdout.splitlines()) == ["0: n1 from.n1", "1: n3 from.n3"]  # their files survived

        # scontrol DOWN makes a loss visible at once (what a health check / operator does).
        t2 = time.monotonic()
        lose_node(env, "n3", mark_down=True)
        assert node_states(env)["n3"].startswith("down")
        marked = time.monotonic() - t2

        # Back in service with empty node-local storage.
        back = restore_node(env, "n2")
        res = srun(env, "-w", "n2", "-N1", "sh", "-c", f'ls -A "${NODE_LOCAL_VAR}"')
        assert res.returncode == 0 and res.stdout == "", (res.stdout, res.stderr)
    print(
        f"n2 down after {noticed:.1f}s (SlurmdTimeout={SLURMD_TIMEOUT}, MessageTimeout={MESSAGE_TIMEOUT}), "
        f"old srun exited rc={rc} after {srun_done:.1f}s, new step took {new_step:.2f}s; "
        f"with scontrol DOWN: {marked:.2f}s; restore_node {back:.1f}s; test {time.monotonic() - t_all:.0f}s"
    )
