"""`mmserve generate` as a user runs it: a subprocess, a checkpoint directory, an image file."""

import subprocess
import sys

from PIL import Image

from mmserve import LLM, SamplingParams


def _run(*args):
    return subprocess.run([sys.executable, "-m", "mmserve.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_prints_the_models_greedy_answer(checkpoint_dirs, tmp_path):
    image = tmp_path / "red.png"
    Image.new("RGB", (90, 60), (220, 20, 20)).save(image)
    model = str(checkpoint_dirs["qwen2_vl"])
    result = _run("generate", "--model", model, "--image", str(image),
                  "--prompt", "What color is it?", "--max-tokens", "6", "--min-tokens", "6")
    assert result.returncode == 0, result.stderr
    offline = LLM(model).chat([{"role": "user", "content": [
        {"type": "image_pil", "image_pil": Image.open(image)}, {"type": "text", "text": "What color is it?"}]}],
        SamplingParams(temperature=0, max_tokens=6, min_tokens=6), use_tqdm=False)[0]
    assert len(offline.outputs[0].token_ids) == 6
    assert result.stdout == offline.outputs[0].text + "\n"


def test_generate_reports_bad_image_cleanly(checkpoint_dirs, tmp_path):
    image = tmp_path / "broken.png"
    image.write_bytes(b"not a png")
    result = _run("generate", "--model", str(checkpoint_dirs["qwen2_vl"]), "--image", str(image),
                  "--prompt", "hi")
    assert result.returncode == 2
    assert "error: " in result.stderr and f"{image} could not be decoded" in result.stderr
    assert "loading" not in result.stderr  # refused before the model loads
    assert "Traceback" not in result.stderr


def test_help_lists_commands():
    result = _run("--help")
    assert result.returncode == 0 and "generate" in result.stdout


def test_serve_with_an_unusable_speculative_config_exits_naming_the_key(checkpoint_dirs, tmp_path):
    # the checkpoint exists; the draft model's does not: start-up stops with the key, no traceback
    result = _run("serve", str(checkpoint_dirs["qwen2_vl"]), "--port", "0", "--speculative-config",
                  f'{{"model": "{tmp_path / "absent"}", "num_speculative_tokens": 2}}')
    assert result.returncode == 2
    assert "error: speculative_config.model=" in result.stderr and "cannot be loaded" in result.stderr
    assert "Traceback" not in result.stderr
