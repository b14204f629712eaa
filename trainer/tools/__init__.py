"""Commands that read a config or a run without training it (jax): `inspect` (with the HLO reader behind
it), `export` and `sample`."""
