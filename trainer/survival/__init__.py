"""jax-free: the run-survival simulator (`python -m trainer survival`): what failures, checkpoint stalls
and restarts cost a long run, and the checkpoint interval that wastes the least."""
