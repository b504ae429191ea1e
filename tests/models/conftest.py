"""Fixtures of the models tier: transformers' greedy tokens of the parity workload, per family and device."""

from __future__ import annotations

import pytest
import torch

from testkit.conversations import NUM_TOKENS, parity_workload
from testkit.families import FAMILIES as SERVED_FAMILIES
from tests.models.helpers import load_processor, to_device


@pytest.fixture(scope="module")
def expected_tokens(all_checkpoints):
    """transformers' greedy tokens per family, one request at a time (computed once per family)."""
    cache = {}

    def get(family, device="cpu"):
        if (family, device) not in cache:
            model_dir = all_checkpoints[family]
            fixture = SERVED_FAMILIES[family]
            processor = load_processor(model_dir)
            ref_model = fixture.reference_class().from_pretrained(model_dir).eval().to(device)
            tokens = []
            for ours in parity_workload(family):
                chat = processor.render_chat(ours)
                prompt = processor.process(chat.prompt, images=chat.images, videos=chat.videos)
                inputs = to_device(fixture.reference_kwargs(model_dir, ours, prompt), device)
                with torch.no_grad():
                    out = ref_model.generate(**inputs, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                                             do_sample=False)
                tokens.append(out[0, inputs["input_ids"].shape[1]:].tolist())
            cache[family, device] = tokens
        return cache[family, device]
    return get
