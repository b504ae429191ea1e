"""The `mmserve` command's flags for what the model reads and returns: the tokenizer, the chat template, the
processor and template kwargs, the sampling defaults, and the runner with its pooling flags (vLLM's flags,
same meaning).

Role: add them to the engine's flag group; JSON-valued flags parsed to dicts (a bad value is argparse's
error). What it does not know: the engine, what the values do (EngineConfig and mmserve/pooling.py check
them).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_text_flags(top: argparse._ArgumentGroup) -> None:
    """The tokenizer, chat template and sampling defaults (vLLM's flags, same meaning)."""
    top.add_argument("--tokenizer", default=argparse.SUPPRESS, metavar="DIR",
                     help="a directory or Hugging Face id holding the tokenizer (tokenizer.json, tokenizer_config.json, "
                          "chat template) to use instead of the model's (default: the model's)")
    top.add_argument("--chat-template", default=argparse.SUPPRESS, metavar="FILE_OR_TEMPLATE",
                     help="a Jinja chat template file, or the template itself, instead of the tokenizer's")
    top.add_argument("--mm-processor-kwargs", default=argparse.SUPPRESS, type=_json_object, metavar="JSON",
                     help="processor kwargs every request starts from, e.g. '{\"max_pixels\": 401408}'; a "
                          "request's own mm_processor_kwargs win (default: none)")
    top.add_argument("--default-chat-template-kwargs", default=argparse.SUPPRESS, type=_json_object, metavar="JSON",
                     help="chat template variables every chat starts from, e.g. '{\"enable_thinking\": false}'; "
                          "a request's chat_template_kwargs win (default: none)")
    top.add_argument("--runner", default=argparse.SUPPRESS, choices=["auto", "generate", "pooling"],
                     help="generate (text), or pooling (embeddings, reranker scores: /v1/embeddings, /v1/score, "
                          "/v1/rerank); auto: pooling when --pooler-config or --hf-overrides is given "
                          "(default: auto)")
    top.add_argument("--pooler-config", default=argparse.SUPPRESS, type=_json_object, metavar="JSON",
                     help="with --runner pooling: task (embed, score), pooling_type (LAST, MEAN, CLS), use_activation "
                          "(normalize embeddings, squash scores), dimensions (default: the checkpoint's "
                          "sentence-transformers files, else LAST, normalized)")
    top.add_argument("--hf-overrides", default=argparse.SUPPRESS, type=_json_object, metavar="JSON",
                     help="vLLM's keys for a reranker scored by its classifier tokens: architectures "
                          "(*ForSequenceClassification), classifier_from_token (the no and yes tokens), "
                          "is_original_qwen3_reranker; and is_matryoshka, matryoshka_dimensions (no other key)")
    top.add_argument("--speculative-config", default=argparse.SUPPRESS, type=_json_object, metavar="JSON",
                     help="speculative decoding as vLLM spells it: '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 3}' (prompt lookup) or '{\"method\": \"draft_model\", "
                          "\"model\": DIR, \"num_speculative_tokens\": 3}' or method mtp (Qwen3.5's head) (default: none)")
    top.add_argument("--generation-config", default=argparse.SUPPRESS, metavar="auto|vllm|FOLDER",
                     help="sampling defaults for what a request leaves unset (temperature, top_p, top_k, min_p, "
                          "repetition_penalty, max_new_tokens as max_tokens): auto, the checkpoint's "
                          "generation_config.json; vllm, none; or a folder's generation_config.json (default: auto)")
