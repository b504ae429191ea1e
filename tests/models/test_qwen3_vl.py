"""Qwen3-VL: mmserve's processor and model against transformers on a tiny random checkpoint (float32).

Images go through transformers' real `Qwen3VLProcessor` (PIL image processor + tokenizer). Its video
processor needs torchvision, which this environment lacks, so for videos `_ReferenceProcessor`
rebuilds `Qwen3VLVideoProcessor._preprocess` from transformers' own pieces: the frame size from
`video_processing_qwen3_vl.smart_resize` (the budget covers all frames), each frame resized,
rescaled and normalised by the PIL image processor (Pillow bicubic instead of torchvision's, so
these pixels are the PIL pipeline's), then `Qwen3VLVideoProcessor.patchify` (pads the frame count
with the last frame). The frames are taken as already sampled at `fps` (metadata with frame indices
0..n-1), and the prompt text comes from the real `Qwen3VLProcessor.replace_video_token` (per-frame
`<t seconds>` and vision start/end).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
from transformers.image_processing_backends import PilBackend
from transformers.image_utils import SizeDict
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
from transformers.video_utils import VideoMetadata

from mmserve.models.generation import generate, prefill_inputs, prompt_positions
from mmserve.models.layers.attention import AttentionMetadata, ContiguousKVCache
from mmserve.models.loader import generation_eos_ids
from testkit.families import whole_items
from testkit.tiny_qwen3_vl import build_qwen3_vl_checkpoint
from tests.models.helpers import full_logits, image_part, load_family, random_image, text_part, user

VIDEO_FPS = 3.0  # not the family default (2), so the timestamps show it is used


class _FrameProcessor(Qwen2VLImageProcessorPil):
    """transformers' PIL image pipeline with the frame size fixed by the video rule; "patchify" hands
    back the whole normalised (C, H, W) frame so the video patchify can run on the stack."""

    target: tuple[int, int] = (0, 0)

    def resize(self, image, size, resample, factor, **kwargs):
        return PilBackend.resize(self, image, SizeDict(height=self.target[0], width=self.target[1]), resample)

    def patchify(self, image, patch_size, merge_size, temporal_patch_size):
        image = np.asarray(image, dtype=np.float32)
        return image.reshape(1, -1), image.shape[1], image.shape[2]


class _ReferenceProcessor(Qwen3VLProcessor):
    fps: float = VIDEO_FPS

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor":  # the video processor registry needs torchvision
            return type(argument)
        return super().check_argument_for_proper_class(argument_name, argument)

    def _process_videos(self, videos, **kwargs):
        vp = self.video_processor
        pixels, grids, metadata = [], [], []
        for frames in videos:
            frames = [f if isinstance(f, Image.Image) else Image.fromarray(np.asarray(f)) for f in frames]
            fp = _FrameProcessor(**{k: getattr(self.image_processor, k) for k in ("image_mean", "image_std")})
            fp.target = smart_resize(len(frames), frames[0].height, frames[0].width, vp.temporal_patch_size,
                                     vp.patch_size * vp.merge_size, vp.size["shortest_edge"], vp.size["longest_edge"])
            stack = fp(images=frames, return_tensors="np")["pixel_values"].reshape(len(frames), 3, *fp.target)
            patches, gt, gh, gw = vp.patchify(torch.from_numpy(stack)[None], vp.patch_size, vp.merge_size,
                                              vp.temporal_patch_size)
            pixels.append(patches[0])
            grids.append([gt, gh, gw])
            metadata.append(VideoMetadata(total_num_frames=len(frames), fps=self.fps,
                                          frames_indices=list(range(len(frames)))))
        out = {"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.tensor(grids),
               "video_metadata": metadata}
        return out, [self.replace_video_token(out, i) for i in range(len(videos))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_qwen3_vl_checkpoint(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def loaded(ckpt):
    return load_family(ckpt)


@pytest.fixture(scope="module")
def reference(ckpt):
    return Qwen3VLForConditionalGeneration.from_pretrained(ckpt).eval()


@pytest.fixture(scope="module")
def ref_processor(ckpt):
    return _ReferenceProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(ckpt),
                               tokenizer=AutoTokenizer.from_pretrained(ckpt),
                               video_processor=Qwen3VLVideoProcessor.from_pretrained(ckpt))


def _video_part(frames):
    return {"type": "video", "video": frames}


def _cases():
    rng = np.random.default_rng(7)
    small, wide, big = random_image(rng, 90, 60), random_image(rng, 700, 30), random_image(rng, 300, 500, "RGBA")
    frames = [random_image(rng, 84, 56) for _ in range(5)]
    tall_frames = [random_image(rng, 40, 150) for _ in range(4)]
    thin_frames = [random_image(rng, 100, 20) for _ in range(3)]  # under one merged patch high; odd count
    return {
        "text": (user(text_part("Hello, who are you?")), [], []),
        "one_image": (user(image_part(small), text_part("Describe the image.")), [small], []),
        "two_images": (user(image_part(wide), text_part("and"), image_part(big), text_part("Which has more?")),
                       [wide, big], []),
        "video": (user(_video_part(frames), text_part("What happens?")), [], [frames]),
        "thin_video": (user(text_part("Look:"), _video_part(thin_frames)), [], [thin_frames]),
        "multi_turn": ([{"role": "system", "content": "You are terse."},
                        user(image_part(small), text_part("What is it?"))[0],
                        {"role": "assistant", "content": "A square."},
                        user(_video_part(tall_frames), text_part("And this?"), image_part(wide))[0]],
                       [small, wide], [tall_frames]),
    }


def _reference_messages(messages):
    out = []
    for m in messages:
        if isinstance(m["content"], str):
            out.append(m)
            continue
        kinds = {"image_pil": {"type": "image"}, "video": {"type": "video"}}
        out.append({"role": m["role"], "content": [kinds.get(p["type"], p) for p in m["content"]]})
    return out


def _both(processor, ref_processor, case):
    messages, images, videos = case
    chat = processor.render_chat(messages)
    ours = processor.process(chat.prompt, images=chat.images, videos=chat.videos,
                             mm_processor_kwargs={"fps": VIDEO_FPS})
    prompt = ref_processor.tokenizer.apply_chat_template(_reference_messages(messages), add_generation_prompt=True,
                                                         tokenize=False)
    assert chat.prompt == prompt
    ref = ref_processor(text=[prompt], images=images or None, videos=videos or None, return_tensors="pt")
    return ours, dict(ref)


def _pixels(prompt, modality):
    return np.concatenate([pixels for pixels, _ in whole_items(prompt, modality)])


@pytest.mark.parametrize("case", ["text", "one_image", "two_images", "video", "thin_video", "multi_turn"])
def test_processor_matches_reference(loaded, reference, ref_processor, case):
    _, processor, _ = loaded
    ours, ref = _both(processor, ref_processor, _cases()[case])
    assert ours.prompt_token_ids == ref["input_ids"][0].tolist()
    for modality, key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                    ("video", "pixel_values_videos", "video_grid_thw")):
        if key in ref:
            grids = [grid for _, grid in whole_items(ours, modality)]
            assert grids == ref[grid_key].tolist()
            assert np.abs(_pixels(ours, modality) - ref[key].numpy()).max() <= 1e-5
    positions, delta = reference.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"],
                                                      ref.get("image_grid_thw"), ref.get("video_grid_thw"))
    assert (ours.positions.columns(0, ours.num_tokens, ours.num_tokens) == positions[:, 0].numpy()).all()
    assert ours.positions.decode_delta == int(delta)
    # the same prompt as unexpanded token ids expands the same way
    _, images, videos = _cases()[case]
    from_ids = processor.process(prompt_token_ids=processor.tokenizer.encode(ours.prompt), images=images,
                                 videos=videos, mm_processor_kwargs={"fps": VIDEO_FPS})
    assert from_ids.prompt_token_ids == ours.prompt_token_ids


def test_video_span_has_timestamps_and_markers(loaded):
    _, processor, _ = loaded
    frames = _cases()["video"][2][0]
    ours = processor.process("<|vision_start|><|video_pad|><|vision_end|>", videos=[frames],
                             mm_processor_kwargs={"fps": VIDEO_FPS})
    # 5 frames pad to 6: three temporal patches at (0+1)/2, (2+3)/2, (4+4)/2 / 3 fps, one item each
    first, *_ = items = ours.items
    assert [i.part for i in items] == [0, 1, 2] and len({i.output_rows for i in items}) == 1
    assert items[-1].content_hash not in {i.content_hash for i in items[:-1]}  # the padded group is its own
    text = processor.tokenizer.decode(ours.prompt_token_ids, False)
    pads = "<|video_pad|>" * first.output_rows
    frames_text = "".join(f"<{t} seconds><|vision_start|>{pads}<|vision_end|>" for t in ("0.2", "0.8", "1.3"))
    assert text == f"<|vision_start|>{frames_text}<|vision_end|>"
    for item in items:  # each item is exactly its frame's pad rows
        assert set(ours.prompt_token_ids[item.offset:item.offset + item.length]) == {processor.config.video_token_id}


def _ref_inputs(ref):
    keys = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw",
            "pixel_values_videos", "video_grid_thw")
    return {k: ref[k] for k in keys if k in ref}


@pytest.mark.parametrize("case", ["text", "one_image", "two_images", "video", "multi_turn"])
def test_logits_match_reference(loaded, reference, ref_processor, case):
    model, processor, spec = loaded
    ours, ref = _both(processor, ref_processor, _cases()[case])
    with torch.no_grad():
        ref_logits = reference(**_ref_inputs(ref)).logits[0]
    our_logits = full_logits(model, ours, spec)
    assert our_logits.shape == ref_logits.shape
    assert (our_logits - ref_logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", ["one_image", "two_images", "video"])
def test_greedy_generation_matches_reference(ckpt, loaded, reference, ref_processor, case):
    model, processor, spec = loaded
    ours, ref = _both(processor, ref_processor, _cases()[case])
    with torch.no_grad():
        out = reference.generate(**_ref_inputs(ref), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    expected = out[0, ref["input_ids"].shape[1]:].tolist()
    stops = tuple(set(spec.eos_token_ids) | set(generation_eos_ids(ckpt)))
    got = list(generate(model, spec, ours, 24, min_new_tokens=24, stop_token_ids=stops))
    assert got == expected


def test_an_mrope_section_past_the_bands_builds_and_matches(tmp_path):
    """[3, 3, 2] with head_dim 16 (8 bands): the h bands at 1, 4, 7 reach past 3 * 3 > 8 and are clipped,
    as transformers' interleaved M-RoPE clips them; the checkpoint loads and its logits match."""
    ckpt = build_qwen3_vl_checkpoint(tmp_path / "narrow", seed=3, head_dim=16, mrope_section=(3, 3, 2))
    model, processor, spec = load_family(ckpt)
    reference = Qwen3VLForConditionalGeneration.from_pretrained(ckpt).eval()
    ref_processor = _ReferenceProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(ckpt),
                                        tokenizer=AutoTokenizer.from_pretrained(ckpt),
                                        video_processor=Qwen3VLVideoProcessor.from_pretrained(ckpt))
    for case in ("one_image", "text"):
        ours, ref = _both(processor, ref_processor, _cases()[case])
        with torch.no_grad():
            ref_logits = reference(**_ref_inputs(ref)).logits[0]
        assert (full_logits(model, ours, spec) - ref_logits).abs().max().item() <= 1e-4


def test_every_deepstack_stream_is_encoded_and_used(loaded, reference, ref_processor):
    model, processor, spec = loaded
    assert spec.num_embedding_streams == 1 + len(model.config.vision.deepstack_visual_indexes) == 3
    assert spec.embed_dim == model.config.text.hidden_size
    ours, ref = _both(processor, ref_processor, _cases()["two_images"])
    with torch.no_grad():
        encoded = model.encode_items([i.payload for i in ours.items])
        ref_out = reference.model.get_image_features(ref["pixel_values"], ref["image_grid_thw"])
    assert [tuple(e.shape) for e in encoded] == [(3, i.output_rows, 64) for i in ours.items]
    for n, item_rows in enumerate(encoded):
        assert (item_rows[0] - ref_out.pooler_output[n]).abs().max() <= 1e-5
        for s, feats in enumerate(ref_out.deepstack_features):
            assert (item_rows[1 + s] - feats[n]).abs().max() <= 1e-5
    # the generic path fuses stream 0 and hands streams 1.. to the decoder, zero at text rows
    embeds, extra = prefill_inputs(model, ours, torch.device("cpu"))
    assert extra is not None and extra.shape == (2, ours.num_tokens, 64)
    assert (extra[:, ~torch.from_numpy(ours.embed_mask)] == 0).all()
    n = ours.num_tokens
    with torch.no_grad():
        without = model(embeds, prompt_positions(ours, 0, n, torch.device("cpu")),
                        ContiguousKVCache(3, 1, n, 2, 32, torch.float32), AttentionMetadata([n], [0]), None)
    assert (model.compute_logits(without) - full_logits(model, ours, spec)).abs().max() > 1e-2
