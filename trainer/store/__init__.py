"""jax-free: the floor every other package stands on: what a run leaves on disk and the names it uses there.

  rundir.py       the run dir's layout, its atomic JSON writer and readers, the run lock
  summary.py      summary.json: the record of its keys, its one writer (update: worker, ledger, rebuild) and reader
  event_names.py  every event name in events.jsonl, and the groups readers ask about
  env_vars.py     every environment variable the trainer reads or sets
  membership.py   who a process is in its group (rank, size, coordinator), from SLURM's or the launcher's variables
  ckpt_files.py   checkpoints as files: where each tier lives, committed and sealed steps, a step's items, its
                  metadata record (Meta)
  manifest.py     a step's content manifests: sizes and sha256 of what each process wrote
  bucket.py       the durable tier in an S3 or GCS bucket (TensorStore, imported only when one is configured)

Nothing here imports another trainer package but config and yamltree: the strings and layouts are the file
format, and changing one breaks every run dir already written.
"""
