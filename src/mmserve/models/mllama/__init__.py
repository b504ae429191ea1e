"""Llama 3.2 Vision (mllama): a tile encoder read by cross-attention layers of a Llama 3 decoder."""
