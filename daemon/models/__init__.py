"""The model catalog and store, compatibility checks, and what is built from a GGUF."""
