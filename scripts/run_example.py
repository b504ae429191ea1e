"""The main job: draw a shapes picture, ask the bundled demo model about it, then serve it.

Generates one image with the demo task's generator, saves it to .run/example.png, prints the
question, the expected answer and the model's answer (through `mmserve generate`), then starts
`mmserve serve` on the demo model, with its chat page at http://127.0.0.1:8000/ (Ctrl-C stops it).
`--no-serve` stops after the answer; `--host H` and `--port N` serve on another address or port. Ctrl-C ends it quietly, at any
point.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".run"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="answer a question about a shapes picture, then serve the demo model")
    parser.add_argument("--no-serve", action="store_true", help="stop after the answer")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address the server listens on (default: 127.0.0.1; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="the server's port (default: 8000)")
    args = parser.parse_args(argv)
    from mmserve.demo import shapes

    WORK.mkdir(exist_ok=True)
    sample = shapes.make_sample(seed=2024, index=4, question_type="shape")
    image = WORK / "example.png"
    sample.images[0].save(image)
    print(f"image: {image}\nquestion: {sample.question}\nexpected: {sample.answer}", flush=True)
    cli = [sys.executable, "-m", "mmserve.entrypoints.cli"]
    # progress lines go to stderr as they happen; the answer is printed once it is complete
    done = subprocess.run([*cli, "generate", "--image", str(image), "--prompt", sample.question, "--max-tokens",
                           "32"], stdout=subprocess.PIPE, text=True)
    answer = done.stdout.strip()
    print(f"model's answer: {answer} ({'right' if answer == sample.answer else 'wrong'})", flush=True)
    if done.returncode != 0 or args.no_serve:
        return done.returncode
    # `mmserve serve` prints what it serves and the chat page's address once its port answers
    print("\nstarting the server on the demo model (Ctrl-C stops it) ...", flush=True)
    return subprocess.call([*cli, "serve", "--host", args.host, "--port", str(args.port)])


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # the child saw the same Ctrl-C and stops on its own
        print("\nstopped", file=sys.stderr)
        sys.exit(130)
