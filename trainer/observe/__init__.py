"""jax-free: what a run writes and what people read: the run dir's files, the event log, TensorBoard,
the goodput ledger, alerts and hardware health, `status`, `report` and the data `audit`."""
