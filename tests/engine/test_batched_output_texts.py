"""The texts of requests that finish in the same step are decoded together, and are the texts the
incremental detokenizer gives each one alone."""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq

import pytest
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.core.sequence import Sequence
from deepinfer.engine.models.demo import write_tokenizer_files
from deepinfer.engine.text.detokenizer import IncrementalDetokenizer, decode_output, decode_outputs
from deepinfer.engine.text.output_processor import OutputProcessor
from deepinfer.engine.text.tokenizer import Tokenizer

TEXTS = ["The weather today is sunny.", "Café crème brûlée: é è ê ë.", "日本の天気は晴れです。",
         "Emoji: 😊🍜☀️ 🇯🇵 done", '{"label": "positive"}']


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d)
    return Tokenizer.from_dir(d)


class CountingTokenizer:
    """A tokenizer that counts its single and batched decode calls (`batch=False`: it has no batch form)."""

    def __init__(self, tok: Tokenizer, batch: bool = True) -> None:
        self.tok, self.single, self.batches = tok, 0, 0
        if batch:
            self.decode_batch = self._decode_batch

    def decode(self, ids: Seq[int], skip_special_tokens: bool = True) -> str:
        self.single += 1
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def _decode_batch(self, id_lists: Seq[Seq[int]], skip_special_tokens: bool = True) -> list[str]:
        self.batches += 1
        return self.tok.decode_batch(id_lists, skip_special_tokens=skip_special_tokens)


def _incremental(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    parts = [detok.add_token(t) for t in output]
    parts.append(detok.finish())
    return "".join(parts)


def _pairs(tok: Tokenizer, seed: int, n: int) -> list[tuple[list[int], list[int]]]:
    """Prompt/output id pairs with the edge cases: empty prompts and outputs, prompts that end inside a
    character, special and out-of-text ids scattered in."""
    rng = random.Random(seed)
    pairs = []
    for j in range(n):
        ids = tok.encode(rng.choice(TEXTS), add_special_tokens=False)
        cut = rng.randint(0, len(ids))
        prompt, output = ids[:cut], ids[cut:]
        for _ in range(rng.randint(0, 4)):
            output.insert(rng.randint(0, len(output)), rng.randrange(tok.vocab_size))
        if j % 5 == 0:
            output = []
        if j % 7 == 0:
            prompt = []
        pairs.append((prompt, output))
    return pairs


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("batched", [True, False])
def test_batch_decode_gives_each_request_its_incremental_text(tok: Tokenizer, seed: int, skip: bool,
                                                             batched: bool) -> None:
    pairs = _pairs(tok, seed, 24)
    counting = CountingTokenizer(tok, batch=batched)
    texts = decode_outputs(counting, pairs, skip)
    assert texts == [_incremental(tok, p, o, skip) for p, o in pairs]
    assert texts == [decode_output(tok, p, o, skip) for p, o in pairs]
    if batched:   # the contexts in one batch, the outputs in another
        assert (counting.batches, counting.single) == (2, 0)
    else:
        assert counting.batches == 0 and counting.single <= 2 * len(pairs)


def _finished(seq_id: int, prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    seq = Sequence(seq_id, prompt, params, seed=seq_id)
    seq.output_token_ids.extend(output)
    return seq


def test_build_outputs_equals_build_output_of_each(tok: Tokenizer) -> None:
    """Requests with and without stop strings and with both skip_special_tokens values, finishing together:
    the same outputs as built one at a time, and no detokenizer left behind."""
    pairs = _pairs(tok, 11, 12)
    params = [SamplingParams(max_tokens=64, stop=["晴"] if i % 3 == 0 else None,
                             skip_special_tokens=i % 2 == 0) for i in range(len(pairs))]

    def finished_seqs(proc: OutputProcessor) -> list[Sequence]:
        seqs = [_finished(i, p, o, sp) for i, ((p, o), sp) in enumerate(zip(pairs, params))]
        for seq in seqs:
            proc.add(seq)
            if seq.detokenizer is not None:
                for t in seq.output_token_ids:
                    seq.detokenizer.add_token(t)
        return seqs

    proc = OutputProcessor(tok)
    seqs = finished_seqs(proc)
    prompts = [f"prompt {i}" for i in range(len(seqs))]
    together = proc.build_outputs(seqs, prompts)
    alone = [proc.build_output(seq, prompt) for seq, prompt in zip(finished_seqs(proc), prompts)]
    assert [o.outputs[0].text for o in together] == [o.outputs[0].text for o in alone]
    assert [o.prompt for o in together] == prompts
    assert all(seq.detokenizer is None for seq in seqs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_finishing_in_one_step_are_reported_together(tiny_checkpoint, async_scheduling: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """EngineCore.run calls on_finish once per step with every request that step finished; the LLM
    decodes their texts in one batch; the texts are those of one request at a time."""
    llm = LLM(model=str(tiny_checkpoint("llama")), device="cpu", cpu_kv_cache_gib=0.25,
              async_scheduling=async_scheduling)
    calls: list[list[int]] = []
    build = llm.engine.outputs.build_outputs

    def record(seqs, prompts):
        calls.append([s.num_output_tokens for s in seqs])
        return build(seqs, prompts)

    monkeypatch.setattr(llm.engine.outputs, "build_outputs", record)
    prompts = ["a b", "c d e", "f", "g h i j"]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in (3, 5, 3, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert calls == [[3, 3], [5, 5]]
    monkeypatch.undo()
    alone = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in alone]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
