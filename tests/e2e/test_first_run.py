"""A newcomer's first commands, as subprocesses: `mmserve serve` says what it serves once its port answers
(and nothing of the kind when the port is taken), logs each refused request with its reason, and
`mmserve chat` drops a bad attachment, lists and refuses commands, confirms /clear; `generate` takes a
Hugging Face id from the local cache."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from PIL import Image

from tests.e2e.conftest import free_port, start_server, stop_server, wait_healthy

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmserve.entrypoints.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300, env=env)


def test_serve_prints_its_summary_once_the_port_answers_and_logs_refusals(checkpoint_dirs, tmp_path):
    server = start_server(str(checkpoint_dirs["qwen2_vl"]), tmp_path / "serve.log", "--log-level", "info",
                          "--num-kv-blocks", "64")
    try:
        wait_healthy(server)
        log = server.log()
        assert "mmserve is ready" in log, log
        summary = log[log.index("mmserve is ready"):]
        assert re.search(r"model\s+\S+ \(qwen2_vl, float32 on cpu\)", summary), summary
        assert re.search(r"context\s+\d+ tokens per request", summary), summary
        # the tiny checkpoint's generation_config.json sets no sampling default
        assert re.search(r"defaults\s+none \(generation_config: auto; --generation-config vllm", summary), summary
        assert re.search(r"KV cache\s+1024 tokens \(auto\)", summary), summary  # 64 blocks of 16
        assert re.search(r"image cache\s+\d+ MiB; encoder in the engine's step", summary), summary
        assert f"{server.url}/v1" in summary and f"chat in your browser: {server.url}/" in summary
        # bound first: uvicorn's own line comes before the summary
        assert log.index("Uvicorn running on") < log.index("mmserve is ready"), log

        refused = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "model": server.model, "messages": [{"role": 7, "content": "hi"}]})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages[0].role"
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        assert re.search(r"INFO\s+mmserve.server: POST /v1/chat/completions -> 400 \(messages\[0\].role\): "
                         r"messages\[0\].role must be a non-empty string", server.log()), server.log()
    finally:
        stop_server(server)


def test_serve_on_a_taken_port_fails_before_loading_the_model(checkpoint_dirs, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = _cli("serve", str(checkpoint_dirs["qwen2_vl"]), "--port", port, "--num-kv-blocks", "64")
    assert result.returncode == 1, result.stderr
    # one line naming the address, before "loading ...": the port is bound before the model loads
    assert result.stderr.strip() == (f"error: cannot serve on 127.0.0.1:{port}: address already in use; stop the "
                                     "server there or pass --port"), result.stderr


def test_chat_drops_a_bad_attachment_and_knows_its_commands(checkpoint_dirs, tmp_path):
    not_an_image = tmp_path / "notes.md"
    not_an_image.write_text("# not a picture\n")
    red = tmp_path / "red.png"
    Image.new("RGB", (64, 48), (220, 20, 20)).save(red)
    session = "\n".join(["/help", f"/image {not_an_image}", "hello", "/bogus", "/clear", f"/image {red}",
                         "what colour?", "/quit"]) + "\n"
    result = _cli("chat", str(checkpoint_dirs["qwen2_vl"]), "--max-tokens", "3", "--num-kv-blocks", "64",
                  stdin=session)
    assert result.returncode == 0, result.stderr
    err = result.stderr
    for command in ("/image PATH", "/clear", "/help", "/quit"):
        assert command in err, err
    assert f"not attached: {not_an_image} could not be decoded" in err, err
    assert "unknown command /bogus; /help lists the commands" in err, err
    assert "conversation cleared" in err and "attached red.png to your next message" in err, err
    assert "error:" not in err, err  # the message after the refused file went through
    answers = result.stdout.split("assistant> ")[1:]
    assert len(answers) == 2, result.stdout  # "hello" and "what colour?" were answered; "/bogus" was not sent


def test_generate_takes_a_hugging_face_id_from_the_local_cache(checkpoint_dirs, tmp_path):
    commit = "fedcba9876543210fedcba9876543210fedcba98"
    repo = tmp_path / "hf" / "hub" / "models--tiny-org--qwen2-vl"
    shutil.copytree(checkpoint_dirs["qwen2_vl"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    by_id = _cli("generate", "tiny-org/qwen2-vl", "--prompt", "Hello", "--max-tokens", "4", "--min-tokens", "4",
                 env=env)
    by_dir = _cli("generate", "--model", str(checkpoint_dirs["qwen2_vl"]), "--prompt", "Hello", "--max-tokens", "4",
                  "--min-tokens", "4", env=env)
    assert by_id.returncode == 0 and by_dir.returncode == 0, by_id.stderr + by_dir.stderr
    assert by_id.stdout == by_dir.stdout
    missing = _cli("generate", "tiny-org/absent", "--prompt", "Hello", env=env)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "`hf download tiny-org/absent`" in missing.stderr, missing.stderr


def test_the_example_run_answers_serves_and_ends_quietly_on_ctrl_c(tmp_path):
    """What `bash scripts/run.sh` runs once set up: an answer, the server's summary, and Ctrl-C (SIGINT to
    the terminal's process group) ending both without a traceback."""
    port = free_port()
    log = tmp_path / "run.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "run_example.py"), "--port", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while "mmserve is ready" not in log.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            time.sleep(0.3)
        text = log.read_text()
        assert "model's answer: " in text and "mmserve is ready" in text, text
        assert f"chat in your browser: http://127.0.0.1:{port}/" in text
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    text = log.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
