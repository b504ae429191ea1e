"""Llama 3.2 Vision (mllama): so far only its image preprocessing; the family itself is not built yet."""
