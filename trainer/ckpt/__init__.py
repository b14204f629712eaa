"""Checkpoints: the whole train state saved and restored, in two tiers, with peer-held copies.

A save (the loop calls it at the step save_policy.decide names, agreed by the whole group):
  save_policy.py   when: step and time schedules of both tiers, SIGTERM, the run's end, a monitor's request
  tiers.py         which tier(s) the step goes to; the durable tier is RUN_DIR/checkpoints (shared), the
                   local one each process's node-local directory
  checkpoint.py    one tier's Orbax CheckpointManager: async save of state, data cursor and metadata, then a
                   sealing thread that writes this process's content manifest (trainer.store.manifest)
  buddy.py         at each local save, every process's shards also go to a process on another node
A restore (at start-up and after every restart):
  tiers.py         saved_meta: the newest step's metadata (ckpt_files.Meta), read once, before anything is written,
                   to check the resume against; then the newest step the group can assemble and verify across
                   both tiers: each process checks its share against the manifests, the verdicts are gathered
                   (checkpoint.agreed: one Verdict for all), a bad checkpoint is moved aside by all and the one
                   before it tried; a lost node's shards come from its buddy's copy
  holdings.py      what each process can restore from (its node's local copies, the durable steps), gathered, and
                   the steps the group can assemble from them (for a local one: whose copy serves each process)
  weights.py       the params alone, for `export`, `sample` and `train.init_from` (trainer.observe.pick
                   chooses which checkpoint, jax-free)
Read without jax (the supervisor, `status`, `checkpoints --verify`, the runbook), in trainer.store, the floor:
ckpt_files.py (where each tier lives, which steps are committed and sealed, the names of a step's items, its
metadata record), manifest.py (sizes and sha256 of what each process wrote) and bucket.py (the durable tier in
an S3 or GCS bucket).
Faults that harm checkpoints on purpose live in trainer.faults.corrupt; a full disk is trainer.supervise.storage.
"""
