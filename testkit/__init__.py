"""What tests and benchmarks share, so that neither imports the other: the tiny random checkpoints of
every served family and their fixtures, the shared conversations, mmserve's model helpers for a
checkpoint, and the routing and P/D simulators. It imports mmserve (and torch, transformers where a
builder needs them), never `tests` or `benchmarks`."""
