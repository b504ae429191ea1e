"""Model families, shared layers, the registry and the checkpoint loader."""
