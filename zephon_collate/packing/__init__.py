"""Packing tokenized documents into flat rows: ``pack_flat``, the streaming ``FlatPacker``, the resumable
``PackedStream``, ``pack_columns`` (documents as columns, into arrays); the reader of documents, the
placement rule, the row engine and the packer's saved state."""
