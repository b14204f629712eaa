"""trainer: fault-tolerant, deterministic, resumable GPT training on JAX."""
