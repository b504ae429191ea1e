"""Encoder workers: the vision side of a family model in other processes (`process`) or Ray actors (`ray`);
no KV, no language model, no request state."""
