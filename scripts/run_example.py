"""Draw an example image, then ask `mmserve generate` about it and print the answer.

Until the bundled demo model lands, the model is a tiny random Qwen2-VL checkpoint built here
(in .run/, once), so the answer is noise — but it goes through the real processor and model.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".run"


def draw_example(path: Path) -> None:
    img = Image.new("RGB", (160, 120), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    draw.ellipse((15, 30, 65, 80), fill=(220, 20, 20))
    draw.rectangle((95, 40, 140, 85), fill=(20, 40, 220))
    img.save(path)


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.tiny_checkpoints import build_checkpoint

    WORK.mkdir(exist_ok=True)
    model_dir = WORK / "tiny-qwen2-vl"
    if not (model_dir / "config.json").is_file():
        print(f"building a tiny random Qwen2-VL checkpoint in {model_dir} ...", flush=True)
        build_checkpoint(model_dir, "qwen2_vl")
    image = WORK / "example.png"
    draw_example(image)
    question = "Describe the image."
    print(f"image: {image}\nquestion: {question}", flush=True)
    cmd = [sys.executable, "-m", "mmserve.entrypoints.cli", "generate", "--model", str(model_dir),
           "--image", str(image), "--prompt", question, "--max-tokens", "24", "--min-tokens", "8"]
    print("answer: ", end="", flush=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
