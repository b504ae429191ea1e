"""The offline API as a vLLM user drives it: prompt forms, sampling, stops, aborts, errors, stats."""

import base64
import io

import numpy as np
import pytest
from PIL import Image

from mmserve import LLM, InvalidInputError, SamplingParams
from tests.models.helpers import random_image

STATS_KEYS = {"requests_finished", "prompt_tokens", "prompt_tokens_computed", "prefix_cache_hit_tokens",
              "generation_tokens", "num_preemptions", "kv_blocks_total", "kv_blocks_free", "encoder_items_encoded"}
IMAGE_PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n" \
               "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def llm(checkpoint_dirs):
    return LLM(str(checkpoint_dirs["qwen2_vl"]), max_num_batched_tokens=64)


@pytest.fixture
def img():
    return random_image(np.random.default_rng(7), 80, 60)


def greedy(n=8):
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n)


def test_prompt_forms_and_order(llm, img):
    ids = llm.engine.processor.tokenizer.encode(IMAGE_PROMPT)
    outs = llm.generate(["Hello", {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": img}},
                         {"prompt_token_ids": ids, "multi_modal_data": {"image": [img]}}], greedy(), use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=lambda r: int(r.split("-")[1]))
    assert outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids  # same prompt, text vs ids
    assert outs[1].prompt_token_ids == outs[2].prompt_token_ids
    assert all(len(o.outputs[0].token_ids) == 8 and o.outputs[0].finish_reason == "length" for o in outs)
    assert all(o.finished and o.metrics.first_token_time >= o.metrics.arrival_time for o in outs)
    llm.check_integrity()


def test_sampling_params_per_prompt(llm):
    outs = llm.generate(["a", "b"], [greedy(3), greedy(5)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    with pytest.raises(InvalidInputError, match="2 prompts"):
        llm.generate(["a", "b"], [greedy(3)], use_tqdm=False)


def test_seeded_sampling_is_reproducible_across_batches(llm, img):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, min_tokens=12)
    prompt = {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": img}}
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=7, min_tokens=7)] * 3
    mixed = llm.generate(["x", "long prompt " * 20, prompt, "y"], [others[0], others[1], seeded, others[2]],
                         use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12, min_tokens=12)
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_string_is_cut_from_text(llm):
    base = llm.generate(["Tell me"], greedy(12), use_tqdm=False)[0].outputs[0]
    text = base.text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    cut = text.index(stop)
    out = llm.generate(["Tell me"], SamplingParams(temperature=0, max_tokens=12, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:cut] and stop not in out.text
    kept = llm.generate(["Tell me"], SamplingParams(temperature=0, max_tokens=12, stop=[stop],
                                                    include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:cut + len(stop)]
    llm.check_integrity()


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate(["Count"], greedy(10), use_tqdm=False)[0].outputs[0].token_ids
    stop_id = base[4]
    first = base.index(stop_id)
    out = llm.generate(["Count"], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id


def test_abort_frees_everything_and_others_finish(llm, img):
    engine = llm.engine
    params = greedy(20)
    for i in range(4):
        engine.add_request(f"abort-{i}", engine.process({"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": img}}),
                           params)
    for _ in range(3):
        engine.step()
        engine.check_integrity()
    aborted = engine.abort_request(["abort-1", "abort-3"])
    assert [o.outputs[0].finish_reason for o in aborted] == ["abort", "abort"]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.check_integrity()
    assert set(done) == {"abort-0", "abort-2"}
    assert all(len(o.outputs[0].token_ids) == 20 for o in done.values())
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_bad_prompt_raises_and_engine_keeps_running(llm, img):
    with pytest.raises(InvalidInputError, match=r"prompt 1: .*2 image\(s\) were given"):
        llm.generate(["fine", {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": [img, img]}}],
                     use_tqdm=False)
    with pytest.raises(InvalidInputError, match="unknown prompt keys"):
        llm.generate([{"prompt": "x", "images": [img]}], use_tqdm=False)
    with pytest.raises(InvalidInputError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(["still fine"], greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    llm.check_integrity()


def test_prompt_longer_than_context(checkpoint_dirs):
    small = LLM(str(checkpoint_dirs["qwen2_vl"]), max_model_len=16)
    with pytest.raises(InvalidInputError, match="context is 16 tokens"):
        small.generate(["word " * 40], use_tqdm=False)
    out = small.generate(["hi"], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 16


def test_context_never_exceeds_the_kv_cache(checkpoint_dirs):
    """A request must fit the KV cache alone, or it would wait forever: the context is capped to the
    cache (a prompt over it is refused, generation stops at it), and a configured context that the
    cache cannot hold is refused at start."""
    llm = LLM(str(checkpoint_dirs["qwen2_vl"]), num_kv_blocks=4, block_size=16)
    with pytest.raises(InvalidInputError, match="context is 64 tokens"):
        llm.generate(["word " * 80], use_tqdm=False)
    out = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64
    llm.check_integrity()
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        LLM(str(checkpoint_dirs["qwen2_vl"]), num_kv_blocks=4, block_size=16, max_model_len=65)


def test_chat_with_data_uri_and_local_path(checkpoint_dirs, img, tmp_path):
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    path = tmp_path / "img.png"
    path.write_bytes(buf.getvalue())
    llm = LLM(str(checkpoint_dirs["qwen2_vl"]), allowed_local_media_path=str(tmp_path))

    def conv(url):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is this?"}]}]

    pil = [{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                        {"type": "text", "text": "What is this?"}]}]
    outs = llm.chat([conv(uri), conv(str(path)), pil], greedy(6), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    with pytest.raises(InvalidInputError, match="outside the allowed media directory"):
        llm.chat(conv("/etc/hostname"), use_tqdm=False)


def test_stats_and_engine_args(llm, checkpoint_dirs):
    assert STATS_KEYS <= set(llm.get_stats())
    with pytest.raises(TypeError, match="unknown engine argument 'max_num_sequences'"):
        LLM(str(checkpoint_dirs["qwen2_vl"]), max_num_sequences=4)


def test_pixels_per_request_limit(checkpoint_dirs):
    """Images and video frames that each pass the per-image limit but together hold more pixels than
    max_pixels_per_request are refused, naming the limit; the engine serves on."""
    llm = LLM(str(checkpoint_dirs["qwen2_vl"]), max_pixels_per_request=100 * 100 * 2)
    img = Image.new("RGB", (100, 100), (200, 30, 30))
    two = [{"role": "user", "content": [{"type": "image_pil", "image_pil": img}, {"type": "image_pil", "image_pil": img},
                                        {"type": "text", "text": "Compare."}]}]
    three = [{"role": "user", "content": [*two[0]["content"][:2], {"type": "video", "video": [img] * 2},
                                          {"type": "text", "text": "And?"}]}]
    assert llm.chat(two, greedy(2), use_tqdm=False)[0].outputs[0].finish_reason == "length"  # exactly the limit
    with pytest.raises(InvalidInputError, match="over the limit of 20000 pixels per request"):
        llm.chat(three, greedy(2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.chat(two, greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    llm.check_integrity()


def test_a_hugging_face_repository_id_loads_from_the_local_cache(checkpoint_dirs, tmp_path, monkeypatch):
    """`LLM("ORG/NAME")`, offline, from a Hugging Face cache the test fills with a tiny checkpoint."""
    import shutil

    from mmserve import LLM, SamplingParams

    commit = "89abcdef0123456789abcdef0123456789abcdef"
    repo = tmp_path / "hub" / "models--tiny-org--qwen2-vl"
    shutil.copytree(checkpoint_dirs["qwen2_vl"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    by_id = LLM("tiny-org/qwen2-vl")
    by_dir = LLM(str(checkpoint_dirs["qwen2_vl"]))
    params = SamplingParams(temperature=0, max_tokens=4)
    chat = [{"role": "user", "content": "Hello!"}]
    assert by_id.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids == \
        by_dir.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids
