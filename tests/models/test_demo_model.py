"""The bundled demo model: standard checkpoint files, the engine and transformers giving the same
greedy answers, and the accuracy floors of the shapes task on conversations never trained on."""

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

    from testkit.tiny_checkpoints import reference_inputs

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


FLOOR_SEED, FLOOR_N = 11, 300  # 50 conversations per question type: a floor of 0.95 allows 2 misses
FLOORS = {"count": 0.95, "color": 0.95, "shape": 0.95, "yesno": 0.95, "describe": 0.90, "compare": 0.90}


def test_eval_meets_floors():
    result = evaluate(MODEL_DIR, n=FLOOR_N, seed=FLOOR_SEED)
    assert result.counts == {t: FLOOR_N // len(shapes.QUESTION_TYPES) for t in shapes.QUESTION_TYPES}
    below = {t: round(result.accuracy[t], 3) for t, floor in FLOORS.items() if result.accuracy[t] < floor}
    assert not below, f"below the floors {FLOORS}: {below}"
