"""The jax side: what runs in a worker process next to the accelerator (mesh, model, optimizer, train
state, step, data pipeline, checkpoints, the worker loop). Nothing outside this package imports jax."""
