"""Qwen3.5: hybrid Gated DeltaNet / gated-attention decoder with the Qwen3-VL vision tower (no deepstack)."""
