import copy
import random

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from tests.tiny_models import CORPUS, make_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def stream(tokenizer, text_or_ids, prompt="Hi there.", **params):
    """Feeds the tokens one by one; returns (detokenizer, output_text after each token, stop string or None)."""
    ids = tokenizer.encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), SamplingParams(**params))
    shown, stop = [], None
    for token_id in ids:
        stop = detok.append(token_id)
        shown.append(detok.output_text)
        if stop is not None:
            break
    return detok, shown, stop


def test_text_matches_decoding_the_whole_output_for_random_tokens(tokenizer):
    rng = random.Random(0)
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(len(tokenizer)) if i not in special]
    for _ in range(30):
        prompt = rng.choice(CORPUS)[: rng.randrange(1, 30)]
        ids = [rng.choice(ordinary) for _ in range(rng.randrange(1, 150))] + tokenizer.encode(" end.")
        detok, _, _ = stream(tokenizer, ids, prompt=prompt)
        assert detok.flush() == tokenizer.decode(ids)


def test_multibyte_characters_spanning_tokens_are_never_shown_half_done(tokenizer):
    text = "Zürich, 東京 🙂 and Øresund ☃"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the premise: some tokens are partial characters
    detok, shown, _ = stream(tokenizer, ids)
    assert all("\ufffd" not in s for s in shown)
    assert detok.flush() == text


def test_streamed_text_only_grows(tokenizer):
    detok, shown, _ = stream(tokenizer, "Hello world! 東京 is not ASCII.")
    final = detok.flush()
    assert all(a == final[: len(a)] for a in shown)
    assert all(len(a) <= len(b) for a, b in zip(shown, shown[1:]))


def test_incomplete_trailing_character_is_left_out_at_the_end(tokenizer):
    ids = tokenizer.encode("ok 東")
    partial = ids[:-1] if "\ufffd" in tokenizer.decode(ids[:-1]) else None
    assert partial is not None  # 東 spans more than one token
    detok, _, _ = stream(tokenizer, partial)
    assert detok.flush() == "ok "


def test_stop_string_truncates_the_text(tokenizer):
    detok, shown, stop = stream(tokenizer, "Hello world! How are you today?", stop=["world"])
    assert stop == "world"
    assert detok.output_text == "Hello "


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer):
    detok, _, stop = stream(tokenizer, "Hello world! How are you today?", stop="world", include_stop_str_in_output=True)
    assert stop == "world"
    assert detok.output_text == "Hello world"


def test_stop_string_spanning_several_tokens_is_found(tokenizer):
    text, stop_str = "The capital of France is Paris. The capital", "France is Pa"
    ids = tokenizer.encode(text)
    assert all(stop_str not in tokenizer.decode([i]) for i in ids)
    detok, _, stop = stream(tokenizer, ids, stop=[stop_str])
    assert stop == stop_str
    assert detok.output_text == "The capital of "


def test_text_after_the_stop_string_in_the_same_token_is_dropped(tokenizer):
    detok, _, stop = stream(tokenizer, "Hello world", stop=["wor"])
    assert stop == "wor" and detok.output_text == "Hello "


def test_earliest_stop_string_wins(tokenizer):
    detok, _, stop = stream(tokenizer, "Hello world", stop=["world", "lo w"])
    assert stop == "lo w"
    assert detok.output_text == "Hel"


def test_partial_stop_string_is_never_shown_before_it_matches(tokenizer):
    detok, shown, stop = stream(tokenizer, "Ahoy matey, the sea be calm", stop=["the sea"])
    assert stop == "the sea"
    assert all(s == detok.output_text[: len(s)] for s in shown)
    assert all(not s.endswith(("t", "th", "the", "the ", "the s", "the se")) for s in shown)


def test_held_back_text_is_released_when_it_turns_out_not_to_be_a_stop_string(tokenizer):
    detok, shown, stop = stream(tokenizer, "the sun and the sea", stop=["the sea"])
    assert stop == "the sea"
    assert "the sun and " in shown[-1]
    _, shown, stop = stream(tokenizer, "the sun and the moon", stop=["the sea"])
    assert stop is None and shown[-1] == "the sun and the moon"


def test_flush_returns_the_held_back_tail(tokenizer):
    detok, shown, stop = stream(tokenizer, "Hello wor", stop=["world"])
    assert stop is None
    assert shown[-1] == "Hello "
    assert detok.flush() == "Hello wor"
    assert detok.output_text == "Hello wor"


def test_stop_strings_are_ignored_until_min_tokens(tokenizer):
    ids = tokenizer.encode("Hello world. Hello world.")
    first_world_token = next(n for n in range(1, len(ids) + 1) if "world" in tokenizer.decode(ids[:n]))
    detok, _, stop = stream(tokenizer, ids, stop=["world"], min_tokens=first_world_token)
    assert stop == "world"
    assert detok.output_text == "Hello world. Hello "


def test_special_tokens_are_skipped_by_default(tokenizer):
    ids = tokenizer.encode("Hello") + [tokenizer.eos_token_id] + tokenizer.encode(" there")
    detok, _, _ = stream(tokenizer, ids)
    assert detok.flush() == "Hello there"


def test_special_tokens_are_kept_when_asked(tokenizer):
    ids = tokenizer.encode("Hello") + [tokenizer.eos_token_id] + tokenizer.encode(" there")
    detok, _, _ = stream(tokenizer, ids, skip_special_tokens=False)
    assert detok.flush() == "Hello<|im_end|> there"


def test_special_tokens_in_the_prompt_do_not_leak_into_the_output(tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    detok, _, _ = stream(tokenizer, "Hello world", prompt=prompt, skip_special_tokens=False)
    assert detok.flush() == "Hello world"


def through_transformers(tokenizer):
    """The same tokenizer, but its decode is overridden, so the detokenizer must call it rather than Rust."""
    cls = type(tokenizer)
    wrapped = copy.copy(tokenizer)
    wrapped.__class__ = type(f"Wrapped{cls.__name__}", (cls,), {"decode": lambda self, *a, **k: cls.decode(self, *a, **k)})
    return wrapped


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decoding_through_rust_shows_what_transformers_decode_shows(tokenizer, skip_special_tokens):
    rng = random.Random(1)
    ids = [rng.randrange(len(tokenizer)) for _ in range(300)]  # special tokens included
    assert set(ids) & set(tokenizer.all_special_ids)
    _, direct, _ = stream(tokenizer, ids, skip_special_tokens=skip_special_tokens)
    _, wrapped, _ = stream(through_transformers(tokenizer), ids, skip_special_tokens=skip_special_tokens)
    assert direct == wrapped


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """A Llama-2-style tokenizer: '▁' for spaces, bytes for unknown characters, leading space stripped."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(CORPUS * 4, trainer=trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_style_text_matches_decode_and_keeps_the_space_after_the_prompt(metaspace_tokenizer):
    tok = metaspace_tokenizer
    text = "Hello world! Zürich 東京 🙂 is far."
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    shown = []
    for token_id in ids:
        detok.append(token_id)
        shown.append(detok.output_text)
    assert all("\ufffd" not in s for s in shown)
    assert detok.flush() == tok.decode(ids) == text
    after_prompt = IncrementalDetokenizer(tok, tok.encode("Say", add_special_tokens=False), SamplingParams())
    for token_id in ids:
        after_prompt.append(token_id)
    assert after_prompt.flush() == " " + text
