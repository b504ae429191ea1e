"""Captured graphs: bucket planning (pure Python), capture and replay mechanics, the encoder's and the
decode step's graphs (CUDA graphs, or on the CPU a compiled step or a replay-equivalent for tests)."""
