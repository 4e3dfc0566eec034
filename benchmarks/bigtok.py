"""A realistic-size (128k) byte-level BPE tokenizer for the benchmarks, trained with `tokenizers`.

The shipped corpus (engine/models/data/demo_corpus.txt, ~31 KB, a few thousand distinct words) cannot
yield 128k merges: BPE stops when no pair is left to merge. So the training text is a deterministic
synthetic expansion of it: every corpus word is cut into 2-4 character pieces, and new words are drawn as
2-4 pieces each (seeded RNG, Zipf-like reuse so merges have repeated pairs to learn from), mixed with the
corpus text itself. The result is a genuine 128k-entry BPE vocabulary (merges, byte fallback, specials
first as in the demo tokenizer) whose tokens are corpus-like strings; structured-output masks over it
cost what they cost over a real 128k vocabulary. Built in a few seconds and cached under the temp dir.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from importlib import resources
from pathlib import Path

# Bump when the recipe changes, so a stale cached tokenizer is never reused.
BIGTOK_VERSION = "v1"
LLAMA3_VOCAB = 128256


def _pieces(words: list[str]) -> list[str]:
    out: set[str] = set()
    for w in words:
        for size in (2, 3, 4):
            out.update(w[i:i + size] for i in range(0, max(1, len(w) - size + 1), size))
    return sorted(out)


def synthetic_corpus(num_words: int = 600_000, seed: int = 0) -> list[str]:
    """Lines of corpus text plus generated corpus-like words (deterministic for a given seed)."""
    text = resources.files("deepinfer.engine.models").joinpath("data/demo_corpus.txt").read_text()
    words = text.split()
    pieces = _pieces(words)
    rng = random.Random(seed)
    # Zipf-like: a word drawn for the first time is remembered, and later draws reuse earlier words
    # often, so pairs repeat and BPE keeps finding merges up to a large vocabulary.
    made: list[str] = []
    lines, line = [text], []
    for _ in range(num_words):
        if made and rng.random() < 0.5:
            w = made[int(len(made) * rng.random() ** 3)]
        else:
            w = "".join(rng.choice(pieces) for _ in range(rng.randint(2, 4)))
            made.append(w)
        line.append(w)
        if len(line) == 24:
            lines.append(" ".join(line))
            line = []
    return lines


def build_tokenizer_dir(vocab_size: int = LLAMA3_VOCAB, root: Path | None = None) -> Path:
    """A directory with tokenizer.json + tokenizer_config.json of a `vocab_size` BPE (cached, atomic)."""
    from deepinfer.engine.models.demo import BOS_TOKEN, CHATML_TEMPLATE, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    root = root or Path(tempfile.gettempdir()) / "deepinfer-bench"
    final = root / f"bpe-{vocab_size}-{BIGTOK_VERSION}"
    if (final / "tokenizer.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".bpe-", dir=root))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(synthetic_corpus(), trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise RuntimeError(f"BPE training reached {got} tokens, not {vocab_size}: enlarge synthetic_corpus")
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)])
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": False, "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN, "chat_template": CHATML_TEMPLATE, "clean_up_tokenization_spaces": False,
        "model_max_length": 8192, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))
    try:
        os.replace(tmp, final)
    except OSError:  # another process won the race; its copy is identical
        if not (final / "tokenizer.json").is_file():
            raise
    return final


if __name__ == "__main__":
    import time

    t0 = time.perf_counter()
    d = build_tokenizer_dir()
    print(d, f"{time.perf_counter() - t0:.1f}s")
