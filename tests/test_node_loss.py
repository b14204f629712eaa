"""A node dies and the job heals onto its spare (issue 31, first slice): launch/slurm.sbatch on a private
three-node SLURM cluster (tests/slurm_cluster.py), two nodes training one process each and one spare. The
node of process 1 is lost whole mid-run (slurmd, slurmstepd, task at once; nobody marks it down). The
supervisor must blame that node (not the survivor whose collective failed afterwards), start the next step
on the survivor and the spare inside the same allocation at once (not wait for SLURM to notice the loss,
nor for a step that cannot start), restore from the fast tier (the lost process's shards from the copy the
survivor holds for it, moved to the spare over the collectives; the lost node's tmpfs is gone), and finish
with the bytes of an undisturbed 2-process run.

Skipped without SLURM binaries or root, except under CI (where it must run: .ci/run installs SLURM).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, events, step_losses, summary
from multihost import at_step, audit, job_args, node_of, reference, sbatch_trainer, wait_for
from slurm_cluster import TERMINAL_STATES, job_state, local_slurm, lose_node, node_states, wait_job
from test_slurm_job import _require_slurm

pytestmark = pytest.mark.slow  # trains end to end (fast loop: -m 'not slow')

SLURMD_TIMEOUT, MESSAGE_TIMEOUT = 5, 3  # SLURM itself notices a lost node after about 11-13 s
NODE_LOCAL = "/local_scratch"


def test_lost_node_is_replaced_by_the_spare_and_the_run_is_bitwise_undisturbed(tmp_path, tmp_path_factory):
    _require_slurm()
    ref_run, corpus = reference(tmp_path_factory)
    run, out = tmp_path / "run", tmp_path / "job.out"
    # Steps from 12 on are slowed (the numbers do not change) so that the loss lands mid-run on a fast machine.
    t0 = time.time()
    with local_slurm(
        tmp_path / "slurm",
        nodes=3,
        cpus=2,
        cred_expire=5,
        slurmd_timeout=SLURMD_TIMEOUT,
        message_timeout=MESSAGE_TIMEOUT,
        node_local=NODE_LOCAL,
    ) as env:
        env = dict(env, TRAINER_PYTHON=sys.executable)
        # Each node's local tier lives and dies with it: one path with a private tmpfs on every node, or
        # (where namespaces cannot mount) a folder per node named through {node}.
        tmpfs = env["LOCAL_SLURM_NODE_LOCAL_MODE"] == "tmpfs"
        local = f"{NODE_LOCAL}/ckpt" if tmpfs else f"{tmp_path / 'slurm'}/nodes/{{node}}/local"
        args = job_args(
            run,
            corpus,
            "launch.processes_per_node=1",
            f"checkpoint.local_dir={local}",
            "checkpoint.local_every_steps=4",  # durable every 10 (MICRO)
            "faults=[{kind: slow, step: 12, seconds: 0.3, count: 10}]",
        )
        job = sbatch_trainer(env, nodes=3, per_node=1, out=out, args=args)
        alive = lambda: job_state(job, env) not in TERMINAL_STATES

        victim = at_step(run, 1, 14, alive)  # past the checkpoint at step 10
        lost = node_of(victim["pid"])
        t_kill = time.time()
        lose_node(env, lost)  # no scontrol DOWN: SLURM notices only SlurmdTimeout later
        state = wait_job(job, env, timeout=300)
        log = out.read_text()
        assert state == "COMPLETED", log[-3000:]
        assert node_states(env)[lost].startswith("down")  # what SLURM made of it meanwhile
    wall = time.time() - t0

    evs = events(run)
    starts = [e for e in evs if e["event"] == "worker_start"]
    first_nodes = starts[0]["nodes"]
    assert lost in first_nodes and len(starts) == 2, starts
    spare = next(n for n in ("n1", "n2", "n3") if n not in first_nodes)
    # The lost node is the suspect, for the right reason; the survivor whose collective failed is not.
    suspects = [e for e in evs if e["event"] == "node_suspect"]
    assert [e["node"] for e in suspects] == [lost], suspects
    exit0 = next(e for e in evs if e["event"] == "worker_exit")
    survivor = next(n for n in first_nodes if n != lost)
    # Either SLURM noticed the loss and ended the step ("Node failure on ..."), or the survivor's collective
    # failed first (exit PEER_LOST) and the node whose task was never reported is the one.
    if exit0.get("node_failures"):
        assert exit0["node_failures"] == [lost] and "node failure" in suspects[0]["reason"], (exit0, suspects)
    else:
        assert exit0.get("first_task_error") == [survivor, 82], exit0  # exit_codes.PEER_LOST
        assert "vanished" in suspects[0]["reason"], suspects
    # The next step runs on the survivor and the spare, in the same allocation.
    assert sorted(starts[1]["nodes"]) == sorted([survivor, spare]) and starts[1]["suspect_nodes"] == [lost]
    restored = next(e for e in evs if e["event"] == "restore" and e["time"] > starts[1]["time"])
    # From the fast tier, not durable: the lost process's shards from the copy the survivor held for it.
    local_saves = [e["step"] for e in evs if e["event"] == "checkpoint_saved" and e["tier"] == "local"]
    assert restored["tier"] == "local" and restored["step"] in local_saves and restored["step"] > 10, restored
    assert sorted((s["node"], s["copy"]) for s in restored["sources"].values()) == [
        (survivor, "buddy"),
        (survivor, "state"),
    ], restored
    first_step = next(e for e in evs if e["event"] == "step" and e["time"] > starts[1]["time"])
    # The suspects outlive this supervisor (a requeued job reads them) and `status` lists them.
    st = subprocess.run(
        [sys.executable, "-m", "trainer", "status", str(run)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert st.returncode == 0 and f"- {lost}:" in st.stdout, st.stdout + st.stderr
    assert (run / "suspect_nodes.json").is_file()

    assert summary(run)["params_sha256"] == summary(ref_run)["params_sha256"]
    losses, ref_losses = step_losses(run), step_losses(ref_run)
    assert sorted(losses) == sorted(ref_losses)
    assert all(set(v) == {ref_losses[k][0]} for k, v in losses.items())  # recomputed steps too, bitwise
    st = audit(run, "--compare", str(ref_run))
    assert st["compared_steps"] == 30 and st["rechecked_rows"] > 0, st
    print(
        f"node loss: {lost} lost at step {victim['step']}; exit {exit0}; restart on {starts[1]['nodes']} "
        f"{starts[1]['time'] - t_kill:.1f}s after the kill, first new step ({first_step['step']}) after "
        f"{first_step['time'] - t_kill:.1f}s, restored step {restored.get('step')} "
        f"({ {k: v for k, v in restored.items() if k not in ('event', 'time', 'by')} }); a durable-only restore "
        f"would have gone back to step 10 ({restored['step'] - 10} more steps to recompute); test {wall:.0f}s"
    )


def test_a_frozen_node_is_the_one_blamed_and_a_requeued_job_still_avoids_it(tmp_path, tmp_path_factory):
    """A training process is frozen (SIGSTOP: a node gone silent) on a randomly chosen training node. The
    group hangs; the supervisor must blame that node, and only it (its process stopped pulsing while its
    peer, blocked waiting for it, still pulsed; srun's reports of the kill that follows blame nobody),
    go on with the survivor and the spare, and the job, requeued by an operator, must still avoid it."""
    _require_slurm()
    ref_run, corpus = reference(tmp_path_factory)
    run, out = tmp_path / "run", tmp_path / "job.out"
    victim_process = random.randrange(2)
    args = job_args(
        run,
        corpus,
        "launch.processes_per_node=1",
        "supervisor.step_timeout_s=10",
        "faults=[{kind: slow, step: 12, seconds: 0.3, count: 18}]",
    )
    cluster = dict(nodes=3, cpus=2, cred_expire=5, slurmd_timeout=SLURMD_TIMEOUT, message_timeout=MESSAGE_TIMEOUT)
    with local_slurm(tmp_path / "slurm", **cluster) as env:
        env = dict(env, TRAINER_PYTHON=sys.executable)
        job = sbatch_trainer(env, nodes=3, per_node=1, out=out, args=args)
        alive = lambda: job_state(job, env) not in TERMINAL_STATES

        victim = at_step(run, victim_process, 13, alive)
        frozen = node_of(victim["pid"])
        os.kill(victim["pid"], signal.SIGSTOP)
        # The step after the hang is training on the other two nodes; then an operator requeues the job.
        wait_for(lambda: len([e for e in events(run) if e["event"] == "worker_start"]) == 2, 120, "the restart")
        at_step(run, 0, max(victim["step"] + 2, 16), alive)
        subprocess.run(["scontrol", "requeue", job], env=env, check=True, timeout=30)
        state = wait_job(job, env, timeout=400)
        log = out.read_text()
        assert state == "COMPLETED", log[-3000:]

    evs = events(run)
    (hang,) = [e for e in evs if e["event"] == "hang_detected"]
    assert hang["node"] == frozen and hang["process"] == victim_process and "froze" in hang["why"], hang
    suspects = [(e["node"], "froze" in e["reason"]) for e in evs if e["event"] == "node_suspect"]
    assert suspects == [(frozen, True)], suspects  # not a node srun reported killed after the hang kill
    starts = [e for e in evs if e["event"] == "worker_start"]
    assert len(starts) >= 3 and frozen in starts[0]["nodes"], starts
    for s in starts[1:]:  # after the hang, in this job and in the requeued one: never the frozen node again
        assert frozen not in s["nodes"] and s["suspect_nodes"] == [frozen] and len(s["nodes"]) == 2, s
    assert len({e["pid"] for e in evs if e["event"] == "supervisor_start"}) == 2  # the requeued job's own
    assert summary(run)["params_sha256"] == summary(ref_run)["params_sha256"]
    print(f"hang: process {victim_process} frozen on {frozen} at step {victim['step']}; {hang['why']}")


def test_with_no_spare_the_job_shrinks_and_regrows_when_the_node_is_trusted_again(tmp_path, tmp_path_factory):
    """Two nodes, no spare, launch.min_processes=1. Process 1's task is killed (its node stays up): that node
    is the suspect, so the group shrinks to the survivor (one process, twice the microbatches: same global
    batch, same batches per step). After launch.suspect_retry_minutes the node is trusted again: the shrunk
    group saves, stops and restarts at full size. The data order is exactly the undisturbed run's; the
    numbers differ only by the accumulation order."""
    import jax
    import numpy as np

    from trainer.core import weights
    from trainer.observe import pick

    _require_slurm()
    ref_run, corpus = reference(tmp_path_factory)
    run, out = tmp_path / "run", tmp_path / "job.out"
    args = job_args(
        run,
        corpus,
        "launch.processes_per_node=1",
        "launch.min_processes=1",
        "launch.suspect_retry_minutes=0.1",
        "mesh.data=-1",  # the mesh follows the devices: 2x2x2 on two processes, 1x2x2 on one
        "faults=[{kind: slow, step: 12, seconds: 1.0, count: 18}]",
    )
    cluster = dict(nodes=2, cpus=2, cred_expire=5, slurmd_timeout=SLURMD_TIMEOUT, message_timeout=MESSAGE_TIMEOUT)
    with local_slurm(tmp_path / "slurm", **cluster) as env:
        env = dict(env, TRAINER_PYTHON=sys.executable)
        job = sbatch_trainer(env, nodes=2, per_node=1, out=out, args=args)
        alive = lambda: job_state(job, env) not in TERMINAL_STATES
        victim = at_step(run, 1, 13, alive)
        blamed = node_of(victim["pid"])
        os.kill(victim["pid"], signal.SIGKILL)
        state = wait_job(job, env, timeout=400)
        log = out.read_text()
        assert state == "COMPLETED", log[-3000:]

    evs = events(run)
    starts = [e for e in evs if e["event"] == "worker_start"]
    assert [s["processes"] for s in starts] == [2, 1, 2], starts
    assert blamed not in starts[1]["nodes"] and blamed in starts[2]["nodes"], starts
    assert [e["node"] for e in evs if e["event"] == "node_suspect"] == [blamed]
    assert [e["node"] for e in evs if e["event"] == "node_retried"] == [blamed]
    shrunk = [e["step"] for e in evs if e["event"] == "step" and starts[1]["time"] < e["time"] < starts[2]["time"]]
    assert shrunk, "the shrunk group trained no step"
    (regrow,) = [e for e in evs if e["event"] == "regrow"]
    assert (regrow["processes"], regrow["to"]) == (1, 2), regrow
    # The regrow is a save, not a loss: the full-size group restored exactly the checkpoint the shrunk one saved.
    saved = [e for e in evs if e["event"] == "checkpoint_saved" and e["time"] < starts[2]["time"]][-1]
    restored = next(e for e in evs if e["event"] == "restore" and e["time"] > starts[2]["time"])
    assert saved["reason"] == "preempt" and restored["step"] == saved["step"], (saved, restored)
    st = audit(run, "--compare", str(ref_run))
    assert st["process_counts"] == [1, 2] and st["compared_steps"] == 30, st
    losses, ref_losses = step_losses(run), step_losses(ref_run)
    worst = max(abs(v - ref_losses[k][0]) / abs(ref_losses[k][0]) for k, vs in losses.items() for v in vs)
    assert sorted(losses) == sorted(ref_losses) and worst < 1e-4, worst
    final = [weights.on_cpu(pick.Picked(30, r / "checkpoints" / "30", r, True)).params for r in (run, ref_run)]
    diffs = [float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(*map(jax.tree.leaves, final))]
    print(
        f"shrink and regrow: steps {shrunk} on one process; worst relative loss difference {worst:.2e}, "
        f"largest param difference {max(diffs):.2e}"
    )
