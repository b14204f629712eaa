"""jax-free: the supervisor and launcher that run the workers, detect crashes, hangs and preemption,
restart from the last checkpoint and carry out the loss-spike runbook. Must keep working when the
accelerator stack is broken, so nothing here imports jax (tests/test_layout.py holds that wall)."""
