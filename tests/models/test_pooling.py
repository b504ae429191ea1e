"""The pooling runner offline (`LLM(runner="pooling")`) against transformers on a tiny Qwen3-VL checkpoint shaped
like Qwen3-VL-Embedding (float32): an embedding is transformers' final hidden state pooled (last token, mean,
first token) and normalized, for text, an image and two images, one at a time, in one batch, in small prefill
chunks and with the prefix cache hit; Matryoshka dimensions and the activation; the pooling a checkpoint's
sentence-transformers files ask for; a reranker's score is sigmoid("yes" logit - "no" logit) of transformers'
last position; a pooling LLM refuses generation and a generating one pooling; nothing leaks."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import Qwen3VLForConditionalGeneration

from mmserve import LLM, InvalidInputError, PoolingParams
from testkit.conversations import image_part, random_image, text_part, user
from testkit.models import load_processor
from tests.models.helpers import reference_inputs

# the tiny vocabulary has no single-token "yes" and "no": a reranker's two classifier tokens are any two tokens
NO_TOKEN, YES_TOKEN = "a", "b"
RERANKER = {"architectures": ["Qwen3VLForSequenceClassification"], "classifier_from_token": [NO_TOKEN, YES_TOKEN],
            "is_original_qwen3_reranker": True}
TEXTS = ["hello world", "a picture of a red square on a blue ground", "the quick brown fox " * 12]


@pytest.fixture(scope="module")
def ckpt(all_checkpoints):
    return all_checkpoints["qwen3_vl"]


@pytest.fixture(scope="module")
def reference(ckpt):
    return Qwen3VLForConditionalGeneration.from_pretrained(ckpt).eval()


@pytest.fixture(scope="module")
def embedder(ckpt):
    with LLM(str(ckpt), runner="pooling", max_num_batched_tokens=32, num_kv_blocks=128) as llm:
        yield llm
        llm.check_integrity()


def _conversations():
    rng = np.random.default_rng(3)
    small, wide = random_image(rng, 90, 60), random_image(rng, 200, 40)
    return [user(text_part("Hello, who are you?")),
            user(image_part(small), text_part("Describe the image.")),
            user(image_part(wide), text_part("and"), image_part(small), text_part("Which is wider?"))]


def _prompt(ckpt, messages) -> dict:
    chat = load_processor(ckpt).render_chat(messages)
    return {"prompt": chat.prompt, "multi_modal_data": {"image": chat.images}} if chat.images else chat.prompt


def _hidden(reference, ckpt, messages) -> torch.Tensor:
    """transformers' (tokens, hidden) final hidden states of a conversation."""
    inputs = reference_inputs(ckpt, "qwen3_vl", messages)
    with torch.no_grad():
        return reference.model(**inputs).last_hidden_state[0]


def _text_hidden(reference, embedder, text) -> torch.Tensor:
    ids = embedder.engine.processor.tokenizer.encode(text)
    with torch.no_grad():
        return reference.model(input_ids=torch.tensor([ids])).last_hidden_state[0]


def _cos(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float(a @ b / (a.norm() * b.norm()))


def test_text_embeddings_are_transformers_last_hidden_state_normalized(embedder, reference):
    batch = embedder.embed(TEXTS, use_tqdm=False)  # the long one in 32-token chunks, beside the others
    alone = [embedder.embed(t, use_tqdm=False)[0] for t in TEXTS]
    for text, together, single in zip(TEXTS, batch, alone):
        expected = _text_hidden(reference, embedder, text)[-1]
        vector = torch.tensor(together.outputs.embedding)
        assert _cos(vector, expected) >= 0.9999
        assert abs(float(vector.norm()) - 1.0) < 1e-5
        np.testing.assert_allclose(together.outputs.embedding, single.outputs.embedding, atol=1e-5)
        assert together.outputs.hidden_size == reference.config.text_config.hidden_size


def test_image_embeddings_equal_transformers_and_a_repeat_hits_the_caches(embedder, reference, ckpt):
    conversations = _conversations()
    prompts = [_prompt(ckpt, m) for m in conversations]
    first = embedder.embed(prompts, use_tqdm=False)
    for messages, output in zip(conversations, first):
        assert _cos(output.outputs.embedding, _hidden(reference, ckpt, messages)[-1]) >= 0.9999
    encoded, hits = embedder.get_stats()["encoder_items_encoded"], embedder.get_stats()["prefix_cache_hit_tokens"]
    again = embedder.embed(prompts[1:], use_tqdm=False)  # the same pictures: encoder cache and prefix cache
    assert embedder.get_stats()["encoder_items_encoded"] == encoded
    assert embedder.get_stats()["prefix_cache_hit_tokens"] > hits
    for before, after in zip(first[1:], again):
        np.testing.assert_allclose(before.outputs.embedding, after.outputs.embedding, atol=1e-5)


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_mean_and_first_token_pooling(ckpt, reference, pooling_type):
    with LLM(str(ckpt), runner="pooling", pooler_config={"pooling_type": pooling_type},
             max_num_batched_tokens=32, num_kv_blocks=128) as llm:
        conversations = _conversations()
        outputs = llm.embed([TEXTS[2], _prompt(ckpt, conversations[1])], use_tqdm=False)
        hiddens = [_text_hidden(reference, llm, TEXTS[2]), _hidden(reference, ckpt, conversations[1])]
        for output, hidden in zip(outputs, hiddens):
            expected = hidden.mean(0) if pooling_type == "MEAN" else hidden[0]
            assert _cos(output.outputs.embedding, expected) >= 0.9999
        # every row must be computed: no prefix hit, the second time too
        repeat = llm.embed(TEXTS[2], use_tqdm=False)[0]
        np.testing.assert_allclose(repeat.outputs.embedding, outputs[0].outputs.embedding, atol=1e-5)
        assert llm.get_stats()["prefix_cache_hit_tokens"] == 0
        llm.check_integrity()


def test_matryoshka_dimensions_and_the_activation(embedder, reference):
    raw = embedder.embed(TEXTS[1], PoolingParams(use_activation=False), use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(raw, _text_hidden(reference, embedder, TEXTS[1])[-1].numpy(), atol=1e-4)
    short = embedder.embed(TEXTS[1], PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding
    assert len(short) == 16 and abs(float(np.linalg.norm(short)) - 1.0) < 1e-5
    np.testing.assert_allclose(short, np.asarray(raw[:16]) / np.linalg.norm(raw[:16]), atol=1e-6)
    with pytest.raises(InvalidInputError, match="larger than the model") as refused:
        embedder.embed(TEXTS[1], PoolingParams(dimensions=4096), use_tqdm=False)
    assert refused.value.param == "pooling_params.dimensions"
    embedder.check_integrity()


def test_the_sentence_transformers_files_choose_the_pooling(ckpt, reference, tmp_path):
    copy = shutil.copytree(ckpt, tmp_path / "st")
    (copy / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (copy / "1_Pooling").mkdir()
    (copy / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    with LLM(str(copy), runner="pooling", num_kv_blocks=64) as llm:
        pooling = llm.engine.frontend.pooling
        assert (pooling.pooling_type, pooling.use_activation) == ("MEAN", False)  # no Normalize module
        vector = llm.embed(TEXTS[0], use_tqdm=False)[0].outputs.embedding
        np.testing.assert_allclose(vector, _text_hidden(reference, llm, TEXTS[0]).mean(0).numpy(), atol=1e-4)
    (copy / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        LLM(str(copy), runner="pooling", num_kv_blocks=64)


def test_a_reranker_scores_as_transformers_yes_minus_no(ckpt, reference, embedder):
    tok = embedder.engine.processor.tokenizer
    no, yes = tok.token_to_id(NO_TOKEN), tok.token_to_id(YES_TOKEN)
    documents = ["a red square", "the quick brown fox " * 6, "blue"]
    with LLM(str(ckpt), runner="auto", hf_overrides=RERANKER, max_num_batched_tokens=32, num_kv_blocks=128) as llm:
        assert llm.engine.config.runner == "pooling" and llm.engine.frontend.pooling.task == "score"
        scores = llm.score("what is red?", documents, use_tqdm=False)
        for document, output in zip(documents, scores):
            ids = tok.encode("what is red?" + document)  # vLLM's LLM-as-reranker prompt: the query, then the doc
            with torch.no_grad():
                logits = reference(input_ids=torch.tensor([ids])).logits[0, -1]
            expected = torch.sigmoid(logits[yes] - logits[no]).item()
            assert abs(output.outputs.score - expected) < 1e-3
            assert output.prompt_token_ids == ids
        with pytest.raises(InvalidInputError, match="score"):
            llm.embed("x", use_tqdm=False)
        llm.check_integrity()


def test_an_embedding_model_scores_by_cosine(embedder):
    scores = embedder.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
    vectors = [o.outputs.embedding for o in embedder.embed(TEXTS, use_tqdm=False)]
    for output, vector in zip(scores, vectors[1:]):
        assert abs(output.outputs.score - _cos(vectors[0], vector)) < 1e-6
    with pytest.raises(InvalidInputError, match="data_1 has 2 entries"):
        embedder.score(TEXTS[:2], TEXTS, use_tqdm=False)


def test_each_runner_refuses_the_other_runners_calls(embedder, ckpt):
    for call in (lambda: embedder.generate("x", use_tqdm=False), lambda: embedder.chat(user(text_part("x")))):
        with pytest.raises(InvalidInputError, match="runner='generate'") as refused:
            call()
        assert refused.value.param == "runner"
    with LLM(str(ckpt), num_kv_blocks=64) as generating:
        with pytest.raises(InvalidInputError, match="runner='pooling'"):
            generating.embed("x", use_tqdm=False)
    with pytest.raises(ValueError, match="not supported by mmserve"):
        LLM(str(ckpt), runner="pooling", pooler_config={"pooling_type": "LAST", "softmax": True})
    with pytest.raises(ValueError, match="not a token"):
        LLM(str(ckpt), runner="pooling", hf_overrides={**RERANKER, "classifier_from_token": ["no", "yes"]})
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(str(ckpt), runner="generate", pooler_config={"pooling_type": "MEAN"})
