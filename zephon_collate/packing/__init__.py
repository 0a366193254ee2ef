"""Packing tokenized documents into flat rows: ``pack_flat``, the streaming ``FlatPacker``, the resumable
``PackedStream``; the reader of documents, the row engine and the packer's saved state."""
