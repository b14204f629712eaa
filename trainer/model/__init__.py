"""The model (jax): the GPT-2 and Llama decoders, their hand-written building blocks, the LM head with its
loss, and Hugging Face's formats of the same params."""
