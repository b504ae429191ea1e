"""The engine on a CUDA device against the same engine on the CPU, for every served family.

Role: a check to run by hand on a machine with a GPU (it is not part of the test suite, which runs
on CPUs): build each family's tiny random checkpoint, run the engine-parity workload of
tests/models/test_engine_parity.py through `LLM(device="cuda")` with default settings, with
`max_num_batched_tokens=32` (chunks cut through images) and with prefix caching run twice, and
compare the greedy tokens with the CPU engine's (which the test suite compares with transformers).
Prints one line per case and one JSON line last.

What it does not know: anything beyond the offline API and the test fixtures.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from mmserve import LLM, SamplingParams  # noqa: E402
from testkit.conversations import parity_workload  # noqa: E402
from testkit.families import FAMILIES  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=10, min_tokens=10)


def tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.chat(parity_workload(), GREEDY, use_tqdm=False)
    llm.check_integrity()
    return [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    assert torch.cuda.is_available(), "no CUDA device"
    results = {}
    root = Path(tempfile.mkdtemp())
    for i, (name, fixture) in enumerate(FAMILIES.items()):
        model_dir = str(fixture.build(root / name, i))
        cpu = tokens(LLM(model_dir))
        for case, kwargs in {"defaults": {}, "chunked_32": {"max_num_batched_tokens": 32},
                             "bfloat16": {"dtype": "bfloat16"}}.items():
            started = time.perf_counter()
            got = tokens(LLM(model_dir, device="cuda", **kwargs))
            same = sum(a == b for a, b in zip(got, cpu))
            results[f"{name}/{case}"] = {"identical_to_cpu": same, "compared": len(cpu),
                                         "wall_s": round(time.perf_counter() - started, 2)}
            print(name, case, results[f"{name}/{case}"], flush=True)
        llm = LLM(model_dir, device="cuda")
        first, second = tokens(llm), tokens(llm)
        hits = llm.get_stats()["prefix_cache_hit_tokens"]
        results[f"{name}/prefix_cache_twice"] = {"identical_to_cpu": sum(a == b == c for a, b, c in
                                                                         zip(first, second, cpu)),
                                                 "compared": len(cpu), "prefix_cache_hit_tokens": hits}
        print(name, "prefix_cache_twice", results[f"{name}/prefix_cache_twice"], flush=True)
    print(json.dumps({"check": "gpu", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      "results": results}, separators=(",", ":")))


if __name__ == "__main__":
    main()
