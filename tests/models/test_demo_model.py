"""The bundled demo model: standard checkpoint files, and the engine and transformers giving the
same greedy answers. (The accuracy-floor test joins when a checkpoint meets the floors.)"""

from __future__ import annotations

import json

import torch

from mmserve.demo import shapes
from mmserve.demo.eval import default_model_dir, evaluate

MODEL_DIR = default_model_dir()

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "preprocessor_config.json", "generation_config.json")
AGREEMENT_SEED, AGREEMENT_N = 12, 50


def test_checkpoint_files():
    for name in FILES:
        assert (MODEL_DIR / name).is_file(), name
    assert sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file()) <= 20 * 1024 * 1024
    assert "chat_template" in json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert json.loads((MODEL_DIR / "config.json").read_text())["architectures"] == ["Qwen2VLForConditionalGeneration"]


def _transformers_answers(samples: list[shapes.Sample]) -> list[str]:
    import transformers

    from tests.fixtures.tiny_checkpoints import reference_inputs

    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(MODEL_DIR).eval()
    tok = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    answers = []
    for sample in samples:
        messages = [{"role": "user", "content": [{"type": "image"}] * len(sample.images)
                     + [{"type": "text", "text": sample.question}]}]
        inputs, _ = reference_inputs(MODEL_DIR, messages, images=sample.images)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=32, do_sample=False)
        answers.append(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return answers


def test_engine_and_transformers_agree():
    samples = shapes.make_samples(AGREEMENT_SEED, AGREEMENT_N)
    engine = evaluate(MODEL_DIR, n=AGREEMENT_N, seed=AGREEMENT_SEED).answers
    reference = _transformers_answers(samples)
    diffs = [(i, s.question, e, r) for i, (s, e, r) in enumerate(zip(samples, engine, reference)) if e != r]
    assert not diffs, f"{len(diffs)} answers differ (index, question, engine, transformers): {diffs[:5]}"
