"""The worker process's training side (jax): building a worker, the train state and its optimizer, the pure
step, the data pipeline, the loop and how an attempt ends. The model is trainer.model, the mesh and the
group's agreement trainer.parallel, checkpoints trainer.ckpt."""
