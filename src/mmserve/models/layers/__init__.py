"""Layers shared by model families: rotary embeddings, norms, MLPs, attention wrappers."""
