"""Vision code more than one family runs: the SigLIP tower, the Qwen-style patch image processor, the
Qwen ViT's segment attention. A family imports what it shares from here, never from another family."""
