"""Pure-Python engine core: requests, KV block bookkeeping, scheduling. Imports no torch."""
