"""The CPU's wing of the runner: mmserve's native kernels (built, cached and loaded by `native`), the
weight layouts the CPU's matmuls want, the attention kernel's plan, and the compiled CPU decode step."""
