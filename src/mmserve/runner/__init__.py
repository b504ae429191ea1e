"""torch lives here: the step (model runner, batch, fusion, attention, KV storage and quantization, sampler,
the runner's state) at the top level, and its wings: `cpu/` (native kernels, the CPU layout, the compiled
CPU step), `graphs/` (captured graphs and their buckets), `encoder/` (encoder runner, pool boundary,
async dispatch)."""
