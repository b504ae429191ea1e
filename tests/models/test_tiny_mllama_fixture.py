"""The tiny Llama 3.2 Vision checkpoint of testkit/tiny_mllama.py, against transformers alone.

It documents the fixture for the mllama family to come: transformers loads it offline, its chat template
renders as the hub's does, its processor tiles and masks as the model expects, and greedy `generate`
runs with no image, one and two. Nothing of mmserve is used.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from jinja2.exceptions import TemplateError
from transformers import MllamaForConditionalGeneration, MllamaProcessor

from testkit.conversations import random_image
from testkit.tiny_mllama import (
    IMAGE_TOKEN,
    MAX_IMAGE_TILES,
    NAMED_SPECIAL,
    NUM_SPECIAL,
    TILE,
    build_tiny_mllama,
    mllama_reference_inputs,
)

DATE = "26 Jul 2024"
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
ONE_IMAGE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
TWO_IMAGES = [{"role": "user", "content": [
    {"type": "text", "text": "Which image has more shapes? The first"}, {"type": "image"},
    {"type": "text", "text": " or the second"}, {"type": "image"}, {"type": "text", "text": "?"}]}]
TEXT_ONLY = [SYSTEM, {"role": "user", "content": "What color is the circle?"}]
HEADER = "<|start_header_id|>{}<|end_header_id|>\n\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_mllama(tmp_path_factory.mktemp("tiny_mllama"), seed=0)


@pytest.fixture(scope="module")
def processor(model_dir):
    return MllamaProcessor.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def model(model_dir):
    return MllamaForConditionalGeneration.from_pretrained(model_dir, local_files_only=True).eval()


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(0)
    # wide: a 1x3 grid of tiles; tall: 2x1
    return random_image(rng, 80, 30), random_image(rng, 20, 50)


def test_checkpoint_files_and_ids(model_dir, processor, model):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "preprocessor_config.json", "processor_config.json", "generation_config.json"):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "mllama"
    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in NAMED_SPECIAL + (IMAGE_TOKEN,)}
    first = ids["<|begin_of_text|>"]
    # Llama 3's layout: the named special tokens at their offsets from the block's start, <|image|> after the block
    assert [ids[t] - first for t in NAMED_SPECIAL] == list(range(len(NAMED_SPECIAL)))
    assert ids[IMAGE_TOKEN] == first + NUM_SPECIAL == len(tok) - 1
    assert processor.image_token_id == ids[IMAGE_TOKEN] == config["image_token_index"]
    assert config["text_config"]["vocab_size"] == ids[IMAGE_TOKEN]
    # the embedding has 8 rows past the text vocabulary (<|image|> among them), the head has none
    assert model.get_input_embeddings().weight.shape[0] == config["text_config"]["vocab_size"] + 8
    assert model.lm_head.weight.shape[0] == config["text_config"]["vocab_size"]
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|begin_of_text|>", "<|eot_id|>",
                                                             "<|finetune_right_pad_id|>")
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
    vision = config["vision_config"]
    assert vision["vision_output_dim"] == vision["hidden_size"] * (len(vision["intermediate_layers_indices"]) + 1)
    assert max(vision["intermediate_layers_indices"]) < vision["num_hidden_layers"]
    image_processor = json.loads((model_dir / "preprocessor_config.json").read_text())
    assert image_processor["size"] == {"height": TILE, "width": TILE}
    assert image_processor["max_image_tiles"] == MAX_IMAGE_TILES == vision["max_num_tiles"]


def test_chat_template(processor):
    def render(messages):
        return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             date_string=DATE)

    tail = "<|eot_id|>" + HEADER.format("assistant")
    assert render(ONE_IMAGE) == ("<|begin_of_text|>" + HEADER.format("user") + "<|image|>Describe the image." + tail)
    assert render(TWO_IMAGES) == ("<|begin_of_text|>" + HEADER.format("user")
                                  + "Which image has more shapes? The first<|image|> or the second<|image|>?" + tail)
    # without images, a system block always comes first: knowledge cutoff, date, then the system message (if any)
    system_block = HEADER.format("system") + f"Cutting Knowledge Date: December 2023\nToday Date: {DATE}\n\n"
    assert render(TEXT_ONLY) == ("<|begin_of_text|>" + system_block + "You are a helpful assistant.<|eot_id|>"
                                 + HEADER.format("user") + "What color is the circle?" + tail)
    assert render(TEXT_ONLY[1:]) == ("<|begin_of_text|>" + system_block + "<|eot_id|>"
                                     + HEADER.format("user") + "What color is the circle?" + tail)
    # the hub's template refuses a system message in a chat with images
    for messages in (ONE_IMAGE, TWO_IMAGES):
        with pytest.raises(TemplateError, match="incompatible with system messages"):
            render([SYSTEM, *messages])
    # rendered ids: one <|begin_of_text|>, one <|image|> per image, nothing expanded
    ids = processor.tokenizer(render(TWO_IMAGES), add_special_tokens=False)["input_ids"]
    assert ids.count(processor.tokenizer.bos_token_id) == 1 and ids[0] == processor.tokenizer.bos_token_id
    assert ids.count(processor.image_token_id) == 2


def test_processor_tiles_and_cross_attention_mask(model_dir, processor, images):
    wide, tall = images
    one = mllama_reference_inputs(model_dir, ONE_IMAGE, [wide])
    ids = one["input_ids"][0].tolist()
    n = len(ids)
    assert one["pixel_values"].shape == (1, 1, MAX_IMAGE_TILES, 3, TILE, TILE)
    assert one["aspect_ratio_mask"].tolist() == [[[1, 1, 1, 0]]] and one["aspect_ratio_mask"].sum() > 1
    assert one["aspect_ratio_ids"].tolist() == [[3]]  # (1, 3) is the 3rd supported aspect ratio, ids from 1
    assert one["cross_attention_mask"].shape == (1, n, 1, MAX_IMAGE_TILES)
    at = ids.index(processor.image_token_id)
    mask = one["cross_attention_mask"][0, :, 0]
    assert not mask[:at].any()  # tokens before the image attend to no tile of it
    assert (mask[at:] == one["aspect_ratio_mask"][0, 0]).all()  # from the image on: its real tiles

    two = mllama_reference_inputs(model_dir, TWO_IMAGES, [wide, tall])
    ids = two["input_ids"][0].tolist()
    first, second = (i for i, t in enumerate(ids) if t == processor.image_token_id)
    assert two["aspect_ratio_mask"].tolist() == [[[1, 1, 1, 0], [1, 1, 0, 0]]]
    mask = two["cross_attention_mask"][0]
    assert mask.shape == (len(ids), 2, MAX_IMAGE_TILES)
    assert not mask[:first].any()
    # each image is seen from its token up to the next image's token, not after
    assert (mask[first:second, 0] == torch.tensor([1, 1, 1, 0])).all() and not mask[first:second, 1].any()
    assert (mask[second:, 1] == torch.tensor([1, 1, 0, 0])).all() and not mask[second:, 0].any()

    # a raw prompt: <|begin_of_text|> moved after the leading <|image|>, and the tokenizer adds one in front
    raw = mllama_reference_inputs(model_dir, "<|image|>Describe the image.", [wide])["input_ids"][0].tolist()
    bos = processor.tokenizer.bos_token_id
    assert raw[:3] == [bos, processor.image_token_id, bos]


def test_greedy_generate(model_dir, model, images):
    wide, tall = images
    vocab = model.config.text_config.vocab_size
    for messages, pictures in ((TEXT_ONLY, []), (ONE_IMAGE, [wide]), (TWO_IMAGES, [wide, tall])):
        inputs = mllama_reference_inputs(model_dir, messages, pictures, date_string=DATE)
        assert ("pixel_values" in inputs) == bool(pictures)
        runs = []
        for _ in range(2):
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False)
            runs.append(out[0, inputs["input_ids"].shape[1]:].tolist())
        assert runs[0] == runs[1] and len(runs[0]) == 5
        assert all(0 <= t < vocab for t in runs[0])


def test_image_reaches_tokens_before_it(model_dir, model, images):
    """In transformers, a token before the first image is not left alone by the cross-attention layers: its
    mask row is all zeros, so the layer attends uniformly over every vision token (padding tiles included)
    and adds that through the attention gate; only the layer's MLP part is zeroed for it. With no image the
    cross-attention layers are skipped altogether."""
    wide, tall = images
    inputs = mllama_reference_inputs(model_dir, ONE_IMAGE, [wide])
    at = inputs["input_ids"][0].tolist().index(model.config.image_token_index)
    other = mllama_reference_inputs(model_dir, ONE_IMAGE, [tall])
    assert torch.equal(other["input_ids"], inputs["input_ids"])
    with torch.no_grad():
        with_image = model(**inputs).logits[0]
        text_only = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits[0]
        other_image = model(**other).logits[0]
    assert at > 0
    assert (with_image[:at] - text_only[:at]).abs().amax() > 1e-3
    assert (with_image[:at] - other_image[:at]).abs().amax() > 1e-3
