"""Mistral 3: a Pixtral vision encoder (2-D RoPE, any image size), a patch-merging projector and a
Mistral decoder (1-D RoPE, optional sliding window); image spans hold `[IMG_BREAK]` / `[IMG_END]`."""
