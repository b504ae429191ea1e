"""Qwen3-VL: vision tower with deepstack mergers, Qwen3 decoder with interleaved M-RoPE."""
