"""The fire drill (`python -m trainer drill`): a configuration run under a seeded schedule of faults, then
checked against an undisturbed run of the same steps. jax-free: it starts trainer runs as subprocesses."""
