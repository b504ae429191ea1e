"""Qwen2-VL and Qwen2.5-VL: vision towers, the M-RoPE language model, the input processor."""
