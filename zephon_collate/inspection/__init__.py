"""Looking at batches: per-row views and warnings, terminal and PNG rendering, the leakage check."""
