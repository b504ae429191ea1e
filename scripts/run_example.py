"""The main job: draw a shapes picture, ask the bundled demo model about it, then serve it.

Generates one image with the demo task's generator, saves it to .run/example.png, prints the
question, the expected answer and the model's answer (through `mmserve generate`), then starts
`mmserve serve` on the demo model, with its chat page at http://127.0.0.1:8000/ (Ctrl-C stops it).
`--no-serve` stops after the answer.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".run"


def main(argv: list[str]) -> int:
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
    if done.returncode != 0 or "--no-serve" in argv:
        return done.returncode
    # `mmserve serve` prints the chat page's address itself ("chat in your browser: http://...")
    print("\nserving the demo model as mmserve-demo at http://127.0.0.1:8000/v1 (Ctrl-C to stop)", flush=True)
    return subprocess.call([*cli, "serve", "--host", "127.0.0.1", "--port", "8000"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
