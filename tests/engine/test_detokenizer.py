"""Incremental detokenization: exact text, complete characters only, stop strings across token boundaries."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from deepinfer.engine.models.demo import write_tokenizer_files
from deepinfer.engine.text.detokenizer import (
    MAX_HELD_TOKENS,
    PROMPT_CONTEXT_TOKENS,
    IncrementalDetokenizer,
)
from deepinfer.engine.text.tokenizer import Tokenizer

TEXTS = [
    "The weather today is sunny with a light breeze.",
    "Café au lait, crème brûlée and jalapeño: é è ê ë.",
    "日本の天気は晴れです。ラーメン 寿司 弁当",
    "Emoji: 😊🍜☀️ 👩‍👩‍👧 🇯🇵 done",
    '{"label": "positive", "note": "naïve café 日本 😊"}',
    "mixed\n\nlines\twith  spaces and ünïcödé",
]
PROMPT = "Label this review: "


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d)
    return Tokenizer.from_dir(d)


class RecordingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call saw."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.lengths = tok, []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def run(detok: IncrementalDetokenizer, ids: Sequence[int]) -> list[str]:
    parts = []
    for t in ids:
        parts.append(detok.add_token(t))
        assert detok.text == "".join(parts)  # text is always exactly what was returned
    parts.append(detok.finish())
    assert detok.text == "".join(parts)
    return parts


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("with_prompt", [False, True])
def test_valid_text_streams_exactly_and_never_emits_broken_characters(
        tok: Tokenizer, text: str, with_prompt: bool) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode(PROMPT) if with_prompt else []
    rec = RecordingTokenizer(tok)
    parts = run(IncrementalDetokenizer(rec, prompt), ids)
    assert "".join(parts) == text == tok.decode(ids)
    assert not any("\ufffd" in p for p in parts)
    assert parts[-1] == ""  # nothing was held back at the end of valid text
    # Only a small window is decoded per step, never the whole sequence.
    assert max(rec.lengths) <= PROMPT_CONTEXT_TOKENS + 8


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences_match_full_decode(tok: Tokenizer, seed: int,
                                                  skip_special_tokens: bool) -> None:
    rng = random.Random(seed)
    pieces = [tok.encode(rng.choice(TEXTS), add_special_tokens=False) for _ in range(3)]
    ids = [t for p in pieces for t in p]
    # Random tokens (lone UTF-8 bytes, specials) spliced in at random places, like an untrained model emits.
    for _ in range(rng.randint(1, 20)):
        ids.insert(rng.randint(0, len(ids)), rng.randrange(tok.vocab_size))
    prompt = tok.encode(PROMPT)[: rng.randint(0, 6)]
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    assert "".join(run(detok, ids)) == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_pure_random_ids_match_full_decode(tok: Tokenizer) -> None:
    rng = random.Random(1234)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))]
        assert "".join(run(IncrementalDetokenizer(tok, []), ids)) == tok.decode(ids)


# Byte-level symbols: "Ã" is the byte 0xC3 (a UTF-8 lead byte), "©" is 0xA9 (a continuation byte).
LONG_INVALID_RUNS = [
    ["©"] * 80 + ["Ã", "©", "a"],
    ["Ã"] * 80 + ["©", "a"],                  # a lead byte completed after a long run of lead bytes
    ["Ã"] * MAX_HELD_TOKENS + ["©", "a"],    # forced emission lands right before the completion
    ["Ã"] * (2 * MAX_HELD_TOKENS) + ["©", "a"],
    ["a", "<|im_end|>"] + ["<|pad|>"] * 80 + ["Ã", "©"],
]


@pytest.mark.parametrize("tokens", LONG_INVALID_RUNS,
                         ids=["continuations", "leads", "leads_at_limit", "leads_at_2x_limit", "specials"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_long_invalid_runs_match_full_decode_with_bounded_window(tok: Tokenizer, tokens: list[str],
                                                                 skip_special_tokens: bool) -> None:
    ids = [tok.token_to_id(t) for t in tokens]
    rec = RecordingTokenizer(tok)
    detok = IncrementalDetokenizer(rec, tok.encode(PROMPT), skip_special_tokens=skip_special_tokens)
    assert "".join(run(detok, ids)) == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert max(rec.lengths) <= PROMPT_CONTEXT_TOKENS + 2 * MAX_HELD_TOKENS + 2


def test_incomplete_character_is_held_until_finish(tok: Tokenizer) -> None:
    ids = tok.encode("ok 日", add_special_tokens=False)
    assert tok.decode(ids[-1:]) == "\ufffd"  # the demo vocab spells 日 as three byte tokens
    detok = IncrementalDetokenizer(tok, [])
    parts = [detok.add_token(t) for t in ids[:-1]]
    assert "".join(parts) == "ok "
    assert detok.finish() == tok.decode(ids[:-1])[len("ok "):]  # the truncated bytes, as a full decode shows
    assert not detok.stopped


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_are_skipped_or_kept(tok: Tokenizer, skip_special_tokens: bool) -> None:
    im_end, eos = tok.token_to_id("<|im_end|>"), tok.eos_token_id
    ids = tok.encode("Sunny", add_special_tokens=False) + [im_end]
    ids += tok.encode(" 日本", add_special_tokens=False)
    ids.append(eos)
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), skip_special_tokens=skip_special_tokens)
    text = "".join(run(detok, ids))
    assert text == ("Sunny 日本" if skip_special_tokens else "Sunny<|im_end|> 日本<|end_of_text|>")


# (output text, stop strings, text without / with the stop string, matched stop string)
STOP_CASES = [
    ("It is sunny. STOP here", ["STOP"], "It is sunny. ", "It is sunny. STOP", "STOP"),
    ("Answer: positive\n\nQuestion: next", ["\n\n"], "Answer: positive", "Answer: positive\n\n", "\n\n"),
    ("天気は晴れ。日本 and more", ["日本"], "天気は晴れ。", "天気は晴れ。日本", "日本"),
    ("emoji 😊 stop", ["😊"], "emoji ", "emoji 😊", "😊"),
    ("abcdef and more", ["abcdef", "cd"], "ab", "abcd", "cd"),      # the match that ends first wins
    ("xyz stop", ["stop", "xyz stop"], "", "xyz stop", "xyz stop"),  # same end: the one starting first
    ('{"label": "neutral"} trailing', ["}"], '{"label": "neutral"', '{"label": "neutral"}', "}"),
    ("no stop in this text", ["STOP", "zzz"], "no stop in this text", "no stop in this text", None),
]


@pytest.mark.parametrize(("text", "stops", "without", "with_stop", "matched"), STOP_CASES)
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_across_token_boundaries(tok: Tokenizer, text: str, stops: list[str], without: str,
                                             with_stop: str, matched: str | None, include: bool) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop=stops, include_stop_str_in_output=include)
    consumed = 0
    for t in ids:
        detok.add_token(t)
        consumed += 1
        if detok.stopped:
            break
    if matched is not None:
        assert detok.stopped and detok.stop_str == matched
        assert consumed < len(ids) or text.endswith(matched)  # stopped as soon as the stop string completed
        assert detok.add_token(ids[0]) == ""  # nothing more after a stop
    else:
        assert not detok.stopped and detok.stop_str is None
    detok.finish()
    assert detok.text == (with_stop if include else without)


def test_stop_string_prefix_is_held_back_then_released(tok: Tokenizer) -> None:
    ids = tok.encode("sunny STOP", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["STOPPED"])
    out = "".join(detok.add_token(t) for t in ids)
    assert out == "sunny "  # "STOP" could still grow into "STOPPED": not returned yet
    assert detok.finish() == "STOP"
    assert detok.text == "sunny STOP" and not detok.stopped


@pytest.mark.parametrize("seed", range(10))
def test_stop_matching_agrees_with_searching_the_full_text(tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    text = " ".join(rng.choice(TEXTS) for _ in range(3))
    stops = []
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(text) - 4)
        stops.append(text[i:i + rng.randint(1, 4)])
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=stops)
    run(detok, ids)
    found = [(text.find(s) + len(s), text.find(s)) for s in stops]
    end, start = min(found)
    assert detok.stopped and detok.text == text[:start]


@pytest.mark.parametrize("stop", [[""], ["ok", 3]])
def test_bad_stop_strings_are_refused(tok: Tokenizer, stop: list) -> None:
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tok, [], stop=stop)


def test_prompt_ending_inside_a_character_does_not_leak_into_output(tok: Tokenizer) -> None:
    ids = tok.encode("日本", add_special_tokens=False)
    prompt, output = ids[:2], ids[2:]  # the prompt ends in the middle of 日
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(run(detok, output)) == tok.decode(output)


def test_works_with_tokenizer_files_on_disk(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path)
    t = Tokenizer.from_dir(tmp_path)
    ids = t.encode("Rain later 🌧", add_special_tokens=False)
    assert "".join(run(IncrementalDetokenizer(t, t.encode("Forecast:")), ids)) == "Rain later 🌧"


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_one_shot_decode_equals_incremental_text(tok: Tokenizer, seed: int,
                                                 skip_special_tokens: bool) -> None:
    from deepinfer.engine.text.detokenizer import decode_output

    rng = random.Random(100 + seed)
    ids = tok.encode(rng.choice(TEXTS), add_special_tokens=False)
    for _ in range(rng.randint(0, 15)):
        ids.insert(rng.randint(0, len(ids)), rng.randrange(tok.vocab_size))
    prompt = tok.encode(PROMPT + rng.choice(TEXTS))[-rng.randint(0, 9):]
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    incremental = "".join(run(detok, ids))
    assert decode_output(tok, prompt, ids, skip_special_tokens) == incremental
