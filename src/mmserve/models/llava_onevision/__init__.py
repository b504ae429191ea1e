"""LLaVA-OneVision: a SigLIP vision tower, a two-layer projector and a Qwen2 decoder (1-D RoPE)."""
