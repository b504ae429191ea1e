"""Beam search (`LLM.beam_search`) equals transformers' `generate(num_beams=W, num_return_sequences=W,
do_sample=False)` on the tiny checkpoints: the same hypotheses in the same order, the same scores (to
float tolerance), for W in {2, 3}, with and without a length penalty and each early-stopping rule, on a
text and a multimodal prompt; nothing leaks afterwards (check_integrity).

The tiny random checkpoints rarely pick their real EOS ids, so each search runs on a copy whose
generation_config names as EOS a few tokens the model does pick (its own greedy continuation's): the
hypotheses then end both ways (an EOS id, max_tokens), and the early-stopping rules decide.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mmserve import LLM, BeamSearchParams, InvalidInputError
from mmserve.engine.beam_driver import BeamStepFailed
from mmserve.faults import FaultPlan
from testkit.conversations import image_part, random_image, text_part, user
from testkit.families import FAMILIES
from tests.models.helpers import load_processor

MAX_TOKENS = 8
BEAM_FAMILIES = tuple(FAMILIES)  # every family the engine serves


def _conversation(multimodal: bool):
    import numpy as np

    if multimodal:
        return user(image_part(random_image(np.random.default_rng(3), 64, 48)), text_part("What is in it?"))
    return user(text_part("Tell me a story about a fox."))


def _raw_prompt(llm, messages):
    chat = llm.engine.processor.render_chat(messages)
    return {"prompt": chat.prompt, "multi_modal_data": {"image": chat.images}} if chat.images else chat.prompt


@pytest.fixture(scope="module", params=BEAM_FAMILIES)
def beam_setup(request, all_checkpoints, tmp_path_factory):
    """(family, checkpoint copy with picked EOS ids, LLM, the reference model)."""
    family = request.param
    source = all_checkpoints[family]
    model_dir = tmp_path_factory.mktemp(f"beam-{family}") / "model"
    shutil.copytree(source, model_dir)
    llm = LLM(str(source))
    picked = set()
    for multimodal in (False, True):
        (out,) = llm.beam_search([_raw_prompt(llm, _conversation(multimodal))],
                                 BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, ignore_eos=True))
        # tokens the beams meet a few steps in: as EOS ids they end some hypotheses early, not all
        picked |= {out.sequences[0].tokens[-MAX_TOKENS + 2], out.sequences[1].tokens[-MAX_TOKENS + 4]}
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config["eos_token_id"] = sorted(picked)[:2]  # few: max(2, 1 + EOS ids) x 3 candidates fit the 20 logprobs
    config_path.write_text(json.dumps(config))
    llm.shutdown()
    ours = LLM(str(model_dir))
    reference = FAMILIES[family].reference_class().from_pretrained(model_dir).eval()
    yield family, model_dir, ours, reference
    ours.shutdown()


def _reference(family, model_dir, reference, messages, prompt, params, eos):
    inputs = FAMILIES[family].reference_kwargs(model_dir, messages, prompt)
    with torch.no_grad():
        out = reference.generate(**inputs, num_beams=params.beam_width, num_return_sequences=params.beam_width,
                                 do_sample=False, max_new_tokens=params.max_tokens, min_new_tokens=0,
                                 length_penalty=params.length_penalty, eos_token_id=list(eos),
                                 pad_token_id=eos[0], output_scores=True, return_dict_in_generate=True,
                                 early_stopping=params.early_stopping)
    start = inputs["input_ids"].shape[1]
    lengths = (out.beam_indices + 1).bool().sum(dim=1).tolist()
    sequences = [out.sequences[i, start:start + n].tolist() for i, n in enumerate(lengths)]
    return sequences, out.sequences_scores.tolist()


@pytest.mark.parametrize("width", [2, 3])
@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (0.0, True), (2.0, "never"),
                                                           (-1.0, False), (1.0, True)])
@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "image"])
def test_beam_search_equals_transformers(beam_setup, width, length_penalty, early_stopping, multimodal):
    family, model_dir, llm, reference = beam_setup
    messages = _conversation(multimodal)
    processor = load_processor(model_dir)
    chat = processor.render_chat(messages)
    prompt = processor.process(chat.prompt, images=chat.images, videos=chat.videos)
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    (output,) = llm.beam_search([_raw_prompt(llm, messages)], params)
    llm.check_integrity()
    eos = list(llm.engine.eos_token_ids)
    expected, scores = _reference(family, model_dir, reference, messages, prompt, params, eos)
    got = [s.tokens[prompt.num_tokens:] for s in output.sequences]
    assert got == expected
    assert [s.score for s in output.sequences] == pytest.approx(scores, rel=1e-4, abs=1e-4)
    assert any(s.finish_reason == "stop" for s in output.sequences) or all(len(t) == MAX_TOKENS for t in got)
    for s in output.sequences:
        generated = s.tokens[prompt.num_tokens:]
        assert s.finish_reason == ("stop" if generated[-1] in eos else "length")
        assert s.cum_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(generated, s.logprobs)))
        assert s.score == pytest.approx(s.cum_logprob / len(generated) ** length_penalty, rel=1e-5)


def test_beam_search_ends_both_ways(beam_setup):
    """The picked EOS ids do end hypotheses (so the comparisons above exercise the EOS rules)."""
    _, _, llm, _ = beam_setup
    found = set()
    for lp, es in ((1.0, False), (2.0, "never"), (0.0, True)):
        for multimodal in (False, True):
            (out,) = llm.beam_search([_raw_prompt(llm, _conversation(multimodal))],
                                     BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, length_penalty=lp,
                                                      early_stopping=es))
            found |= {s.finish_reason for s in out.sequences}
    assert found == {"stop", "length"}


def test_beam_search_refuses_what_it_cannot_do(beam_setup):
    _, _, llm, _ = beam_setup
    with pytest.raises(InvalidInputError) as exc:
        llm.beam_search(["hi"], BeamSearchParams(beam_width=7, max_tokens=4))  # 3 x 7 candidates > 20
    assert exc.value.param == "beam_width"
    with pytest.raises(InvalidInputError) as exc:
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    assert exc.value.param == "temperature"
    with pytest.raises(InvalidInputError) as exc:
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    assert exc.value.param == "early_stopping"
    with pytest.raises(InvalidInputError) as exc:
        llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=10**6))
    assert exc.value.param == "max_tokens"
    llm.check_integrity()



def test_a_failed_step_fails_the_search_and_leaks_nothing(all_checkpoints):
    """A beam's step that fails (a planted model-step fault) ends the search with that error; the other
    beams' requests are aborted, and the engine serves on."""
    source = str(all_checkpoints["qwen2_vl"])
    fault = LLM(source).engine.processor.tokenizer.encode("zebra")[0]
    llm = LLM(source, faults=FaultPlan(step_fault_token_id=fault))
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    with pytest.raises(BeamStepFailed, match="test fault"):
        llm.beam_search(["Count to ten.", "a zebra"], params)
    llm.check_integrity()
    (out,) = llm.beam_search(["Count to ten."], params)
    assert len(out.sequences) == 2 and all(len(s.logprobs) == 4 for s in out.sequences)
    llm.check_integrity()
