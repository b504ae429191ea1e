"""Gemma 3 (`Gemma3ForConditionalGeneration`): SigLIP tower + pooled projector + Gemma 3 decoder."""
