"""mmserve's own model, processor and spec for a checkpoint, and a whole prompt's logits in one prefill:
what the model tests compare with transformers and the quantization and offline benchmarks measure.

What it does not know: the engine, the scheduler, any family by name (the registry resolves it).
"""

from __future__ import annotations

import torch

from mmserve.inputs.items import ProcessedPrompt
from mmserve.inputs.media import MediaLimits
from mmserve.models.generation import (
    SequenceCache,
    prefill_inputs,
    prefill_metadata,
    prompt_cross_kv,
    prompt_positions,
)
from mmserve.models.loader import load_model, read_config
from mmserve.models.registry import resolve
from mmserve.models.spec import FamilySpec


def load_processor(model_dir):
    """The family's processor for a checkpoint, without loading weights."""
    family = resolve(read_config(model_dir))
    return family.processor_class(model_dir, family.parse_config(read_config(model_dir)), MediaLimits())


def load_family(model_dir, dtype: str = "float32", device: str = "cpu"):
    """(model, processor, spec) for a checkpoint, as the engine builds them."""
    family = resolve(read_config(model_dir))
    model = load_model(model_dir, dtype, device)
    processor = family.processor_class(model_dir, model.config, MediaLimits())
    return model, processor, family.build_spec(model.config, processor, MediaLimits())


@torch.inference_mode()
def full_logits(model, prompt: ProcessedPrompt, spec: FamilySpec) -> torch.Tensor:
    """(num_tokens, vocab) logits of a whole prompt in one prefill, on the model's device."""
    n = prompt.num_tokens
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    cache = SequenceCache(spec, n, dtype, device)
    embeds, extra = prefill_inputs(model, prompt, device)
    meta = prefill_metadata(prompt, spec, prompt_cross_kv(model, prompt))
    ids = torch.tensor(prompt.prompt_token_ids, dtype=torch.long, device=device)
    hidden = model(embeds, prompt_positions(prompt, 0, n, device), cache, meta, extra, **spec.forward_kwargs(ids))
    return model.compute_logits(hidden)
