"""jax-free: the built-in faults (the config's `faults` list), fired inside the worker process they harm:
crashes, hangs, a lost node, a corrupted checkpoint. The supervisor never imports them; it only sees what
they cause."""
