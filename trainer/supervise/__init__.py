"""jax-free: the supervisor and launcher that run the workers, detect crashes, hangs and preemption,
restart from the last checkpoint and carry out the loss-spike runbook. Must keep working when the
accelerator stack is broken, so nothing here imports jax (tests/test_layout.py holds that wall).

supervisor.py runs the attempts (the loop, the signal handler, main), over the state a session shares
(session.py). attempt.py starts one and pumps its output; watch.py reads the heartbeats once a poll
(trainer.observe.heartbeat.Snapshot) for the hang check (hang.py), the straggler watch (straggler.py) and a
regrow; when an attempt ends, exit_codes.decide() reads the exit policy (exit_codes.POLICY, one record per
exit code) and after_exit.py carries the decision out: the runbook (runbook.py), a wait for disk room
(storage.py), a replica rewind (replica_rewind.py), a restart, a requeue or giving up, and the ledger.
launcher.py, group.py and nodes.py start a group of workers (local or one srun step, each process told who it
is: trainer.store.membership) and blame nodes; guard.py requeues a job whose supervisor was lost.
"""
