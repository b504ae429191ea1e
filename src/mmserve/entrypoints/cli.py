"""The `mmserve` command line.

Role: parse arguments and call the library; no model logic here.
Commands: `generate` — answer one prompt about an image (or none) and print the answer.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from mmserve.errors import InvalidInputError, ModelLoadError


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmserve",
        description="mmserve: serve vision-language models (Qwen2-VL, Qwen2.5-VL) on PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser("generate", help="answer one prompt about an image and print the answer",
                         description="Load a model, ask one question about an image, print the answer.")
    gen.add_argument("--model", required=True, help="checkpoint directory (config.json, *.safetensors, tokenizer)")
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="image file to show the model (repeat for several)")
    gen.add_argument("--prompt", required=True, help="the question or instruction")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    gen.add_argument("--min-tokens", type=int, default=0, help="generate at least this many tokens")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    return parser


def _generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mmserve.inputs.media import MediaLimits
    from mmserve.models.generation import generate
    from mmserve.models.loader import load_model
    from mmserve.models.qwen2_vl.processor import Qwen2VLProcessor

    started = time.perf_counter()
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    model = load_model(args.model, args.dtype, args.device)
    images = [str(Path(p).resolve()) for p in args.image]
    roots = {str(Path(p).parent) for p in images}
    limits = MediaLimits(allowed_local_media_path=roots.pop() if len(roots) == 1 else "/")
    processor = Qwen2VLProcessor(args.model, model.config, limits)
    content = [{"type": "image", "image": p} for p in images] + [{"type": "text", "text": args.prompt}]
    chat = processor.render_chat([{"role": "user", "content": content}])
    prompt = processor.process(chat.prompt, images=chat.images)
    stop = tuple(model.config.eos_token_ids) + tuple(
        t for t in (processor.tokenizer.eos_token_id,) if t is not None)
    print(f"loaded in {time.perf_counter() - started:.1f}s; generating ...", file=sys.stderr, flush=True)
    tokens = list(generate(model, prompt, args.max_tokens, stop, args.min_tokens))
    print(processor.tokenizer.decode(tokens))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
    except (InvalidInputError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
