"""The main job: draw a shapes picture, ask the bundled demo model about it, then serve it.

Generates one image with the demo task's generator, saves it to .run/example.png, prints the
question, the expected answer and the model's answer (through `mmserve generate`), then starts
`mmserve serve` on the demo model, with its chat page at http://127.0.0.1:8000/ (Ctrl-C stops it).
`--no-serve` stops after the answer; `--host H` and `--port N` serve on another address or port. Ctrl-C ends it quietly, at any
point.
"""

from __future__ import annotations

import argparse
import signal
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
    code, answer = _child([*cli, "generate", "--image", str(image), "--prompt", sample.question, "--max-tokens",
                           "32"], capture=True)
    if code == INTERRUPTED:
        return _stopped()
    print(f"model's answer: {answer.strip()} ({'right' if answer.strip() == sample.answer else 'wrong'})",
          flush=True)
    if code != 0 or args.no_serve:
        return code
    # `mmserve serve` prints what it serves and the chat page's address once its port answers
    print("\nstarting the server on the demo model (Ctrl-C stops it) ...", flush=True)
    code, _ = _child([*cli, "serve", "--host", args.host, "--port", str(args.port)])
    return _stopped() if code == INTERRUPTED else code


INTERRUPTED = 130  # a child's exit code after Ctrl-C


def _child(command: list[str], capture: bool = False) -> tuple[int, str]:
    """Run a child to its end. Ctrl-C reaches it from the terminal (same process group) and it stops by
    itself, so this process ignores SIGINT meanwhile (an exit code and a message that do not depend on
    which process saw the signal first); a SIGTERM sent to this process is passed on."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE if capture else None, text=True)
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.SIGTERM: signal.signal(signal.SIGTERM, lambda sig, _: child.send_signal(sig))}
    try:
        out, _ = child.communicate()
        return child.returncode, out or ""
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stopped() -> int:
    print("\nstopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # Ctrl-C while no child runs (making the picture)
        sys.exit(_stopped())
