"""prefillq worker: an RQ SimpleWorker that prefills jobs chunk by chunk, and the CLI."""
