"""The data model, field names, argument checks and how errors quote values."""
