"""jax-free: turning text into prepared token shards once (tokenizers, input formats, the prepared DIR
format and its meta.json, the content-keyed cache, `python -m trainer prepare`, the tokenizer a checkpoint
trained with). The jax side reads the result through grain (trainer.train.data)."""
