"""Layouts: how a batch is laid out, and the chain that turns it into tensors (``docs/architecture.md``)."""
