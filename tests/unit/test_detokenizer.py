import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.inputs.tokenizer import TextTokenizer

TRAINING_TEXT = [
    "The café serves coffee and tea. 日本語のテキストも少しあります。",
    "Hello world! 🙂 Stop here ### and then END of story.",
    "naïve résumé façade — déjà vu. 東京 大阪 🙂🙂",
]
# Characters missing from the training text are encoded byte by byte, so every multi-byte
# character below is split across several tokens.
TEXT = "Hello café 日本語 🙂 and 🎉 über € ok. Stop here ### and then END of story. 東京!"
SPECIAL = "<|endoftext|>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> TextTokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[SPECIAL],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    root = tmp_path_factory.mktemp("tokenizer")
    tok.save(str(root / "tokenizer.json"))
    return TextTokenizer(root)


def stream(tokenizer, ids, chunk=1, **kwargs):
    """Feed ids `chunk` at a time; return (deltas, stop string hit, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt: "), **kwargs)
    deltas, hit = [], None
    for start in range(0, len(ids), chunk):
        hit = detok.update(ids[start:start + chunk])
        deltas.append(detok.take_delta(finished=hit is not None))
        if hit is not None:
            break
    else:
        deltas.append(detok.take_delta(finished=True))
    return deltas, hit, detok


def test_multibyte_characters_really_span_tokens(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_streaming_reproduces_full_decode(tokenizer, chunk):
    ids = tokenizer.encode(TEXT)
    deltas, hit, detok = stream(tokenizer, ids, chunk=chunk)
    assert hit is None
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_skipped_or_kept(tokenizer):
    special_id = tokenizer.token_to_id(SPECIAL)
    ids = tokenizer.encode("ab 🙂") + [special_id] + tokenizer.encode(" cd")
    skipped, _, _ = stream(tokenizer, ids)
    kept, _, _ = stream(tokenizer, ids, skip_special_tokens=False)
    assert "".join(skipped) == tokenizer.decode(ids) == "ab 🙂 cd"
    assert "".join(kept) == tokenizer.decode(ids, skip_special_tokens=False) == f"ab 🙂{SPECIAL} cd"


def test_incomplete_character_at_finish_is_flushed_like_decode(tokenizer):
    ids = tokenizer.encode("x 🎉")[:-1]  # cut in the middle of the emoji's bytes
    deltas, _, detok = stream(tokenizer, ids)
    assert detok.output_text == "".join(deltas) == tokenizer.decode(ids)
    assert detok.output_text.endswith("\ufffd")


@pytest.mark.parametrize("chunk", [1, 4])
def test_stop_string_spanning_tokens_is_cut_and_never_streamed(tokenizer, chunk):
    ids = tokenizer.encode(TEXT)
    deltas, hit, detok = stream(tokenizer, ids, chunk=chunk, stop=("###",))
    assert hit == "###"
    assert detok.output_text == "".join(deltas) == TEXT[:TEXT.index("###")]
    assert not any("#" in d for d in deltas)


def test_stop_string_made_of_multibyte_characters(tokenizer):
    ids = tokenizer.encode(TEXT)
    deltas, hit, detok = stream(tokenizer, ids, stop=("🎉 über",))
    assert hit == "🎉 über"
    assert "".join(deltas) == detok.output_text == TEXT[:TEXT.index("🎉")]


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode(TEXT)
    deltas, hit, detok = stream(tokenizer, ids, stop=("###",), include_stop_str_in_output=True)
    assert hit == "###"
    assert detok.output_text == "".join(deltas) == TEXT[:TEXT.index("###") + 3]


def test_earliest_of_two_stop_strings_wins(tokenizer):
    ids = tokenizer.encode(TEXT)
    # "END" is listed first but "here" occurs earlier; feed everything at once so both are present.
    deltas, hit, detok = stream(tokenizer, ids, chunk=len(ids), stop=("END", "here"))
    assert hit == "here"
    assert detok.output_text == TEXT[:TEXT.index("here")]


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=("#!#",))
    detok.update(tokenizer.encode("abc #"))
    assert detok.take_delta(finished=False) == "abc "  # "#" may start "#!#"
    detok.update(tokenizer.encode("!"))
    assert detok.take_delta(finished=False) == ""  # "#!" still may
    detok.update(tokenizer.encode("x"))
    assert detok.take_delta(finished=False) == "#!x"
    assert detok.take_delta(finished=True) == ""


def test_nothing_held_back_without_stop_strings(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.update(tokenizer.encode("abc #"))
    assert detok.take_delta(finished=False) == "abc #"


def test_updates_after_stop_or_finish_are_ignored(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=("b",))
    assert detok.update(tokenizer.encode("abc")) == "b"
    assert detok.update(tokenizer.encode("b again")) is None
    assert detok.output_text == "a" and detok.stop_string == "b"


class CountingDecoder:
    def __init__(self, tokenizer):
        self.tokenizer, self.decoded_ids = tokenizer, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded_ids += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_is_linear_in_tokens(tokenizer):
    ids = tokenizer.encode(TEXT) * 40
    counter = CountingDecoder(tokenizer)
    detok = IncrementalDetokenizer(counter, tokenizer.encode("a long prompt " * 50), stop=("zzz",))
    for token_id in ids:
        detok.update([token_id])
        detok.take_delta(finished=False)
    detok.take_delta(finished=True)
    assert detok.output_text == TEXT * 40
    assert counter.decoded_ids < 20 * len(ids)
