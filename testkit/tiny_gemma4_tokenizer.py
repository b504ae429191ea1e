"""The tokenizer and chat template of the tiny Gemma 4 checkpoint (testkit/tiny_gemma4.py).

Role: a byte-level BPE trained on the shared test text, with Gemma 4's special tokens spelled as Gemma 4
spells them, saved the way google/gemma-4-E2B-it's tokenizer is: tokenizer.json, a tokenizer_config.json
naming every control token by the attribute transformers' `Gemma4Processor` reads (`image_token`,
`boi_token`, `eoi_token`, `audio_token`, `boa_token`, `eoa_token`, ...; `<|video|>` as the one
`extra_special_tokens` entry, as on the hub), and chat_template.jinja.

Ids: `<pad>` 0, `<eos>` 1, `<bos>` 2, `<unk>` 3, `<mask>` 4, then the control tokens (turns, thinking
channel, tool declarations, calls and responses, the string delimiter `<|"|>`) from 5, as Gemma 4 keeps
its control tokens at the start of the vocabulary; the trained pieces; the media tokens last, in Gemma
4's order (`<|image>` `<|audio>` `<|image|>` `<|audio|>` `<image|>` `<audio|>` `<|video|>`), as Gemma 4
keeps them at the end of its vocabulary. Every one is a special token (decoding with
`skip_special_tokens=False` keeps tool calls' `<|"|>` delimiters). Like Gemma's tokenizer, it prepends
`<bos>` (the chat template writes its own, so rendered prompts are tokenized without special tokens).

The chat template is the official Gemma 4 instruction-tuned template, byte for byte: google/gemma-4-31B-it's
chat_template.jinja as llama.cpp keeps it (models/templates/google-gemma-4-31B-it.jinja, from the
llama-cpp-python 0.3.36 sdist's vendored llama.cpp); the hub's gemma-4-26B-A4B-it ships the same 16.4 kB
file. It lives beside this module as gemma4_chat_template.jinja (too long for a Python module).

Deviation from the hub: tokenizer_config.json names `TokenizersBackend`, not `GemmaTokenizer`:
transformers' `GemmaTokenizer` rebuilds a SentencePiece-style normalizer over tokenizer.json, which
would break a byte-level BPE.

What it does not know: anything about mmserve; it only writes files the way Hugging Face does.
"""

from __future__ import annotations

import json
from pathlib import Path

from testkit.tiny_checkpoints import TRAINING_TEXT

TEMPLATE_PATH = Path(__file__).with_name("gemma4_chat_template.jinja")
BASE_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
CONTROL_TOKENS = ("<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                  "<tool_response|>", '<|"|>', "<|think|>", "<|channel>", "<channel|>", "<|turn>", "<turn|>")
MEDIA_TOKENS = ("<|image>", "<|audio>", "<|image|>", "<|audio|>", "<image|>", "<audio|>", "<|video|>")
ALL_TOKENS = BASE_TOKENS + CONTROL_TOKENS + MEDIA_TOKENS
# tokenizer_config.json's named tokens, as google/gemma-4-E2B-it's names them
NAMED_TOKENS = {
    "audio_token": "<|audio|>", "boa_token": "<|audio>", "boi_token": "<|image>", "eoa_token": "<audio|>",
    "eoc_token": "<channel|>", "eoi_token": "<image|>", "eot_token": "<turn|>", "escape_token": '<|"|>',
    "etc_token": "<tool_call|>", "etd_token": "<tool|>", "etr_token": "<tool_response|>",
    "image_token": "<|image|>", "soc_token": "<|channel>", "sot_token": "<|turn>",
    "stc_token": "<|tool_call>", "std_token": "<|tool>", "str_token": "<|tool_response>",
    "think_token": "<|think|>",
}
VIDEO_TOKEN = "<|video|>"
# Gemma-like text besides the shared test text: turns, thoughts, tool calls, timestamps of video frames
EXTRA_TEXT = ("user model system thought call:get_weather{city:Paris,days:3} response:get_weather{temp:21} "
              "00:00 00:01 00:02 00:03 a\n\nb\n\n\nc " * 8)
# trained pieces: with the 24 special tokens the vocabulary has 432 = 16 * 27 entries
TRAINED_VOCAB = 425


def chat_template() -> str:
    return TEMPLATE_PATH.read_text()


def build_tokenizer():
    """The fast tokenizer (transformers' `TokenizersBackend`) with Gemma 4's special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TRAINED_VOCAB,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(BASE_TOKENS + CONTROL_TOKENS), show_progress=False)
    tok.train_from_iterator([TRAINING_TEXT, EXTRA_TEXT], trainer=trainer)
    tok.add_special_tokens(list(MEDIA_TOKENS))
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", mask_token="<mask>",
                                   padding_side="left", extra_special_tokens=[VIDEO_TOKEN], **NAMED_TOKENS)
    fast.chat_template = chat_template()
    return fast


def token_ids(tok) -> dict[str, int]:
    """Every special token's id, by spelling."""
    return {t: tok.convert_tokens_to_ids(t) for t in ALL_TOKENS}


def save_tokenizer(tok, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json (with the hub's `processor_class`) and chat_template.jinja."""
    tok.save_pretrained(out_dir)
    path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["processor_class"] = "Gemma4Processor"
    path.write_text(json.dumps(dict(sorted(config.items())), indent=2, ensure_ascii=False) + "\n")
