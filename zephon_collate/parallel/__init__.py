"""Training on many ranks: exact loss normalization, equal steps per rank, context-parallel gather."""
