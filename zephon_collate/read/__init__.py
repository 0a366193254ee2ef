"""The door: every input read once into one columnar type (:mod:`.columns`) and checked (:mod:`.rules`)."""
