"""The demo model: a small random-weight Llama-shaped checkpoint plus a BPE tokenizer trained on shipped text.

The demo model exists so that examples, tests and CPU runs have a real Hugging Face-layout model directory
without any network access. Its weights are random (seeded), so **the text it generates is meaningless**: it
exercises the whole engine (tokenizer, chat template, paged attention, sampling, structured output) but says
nothing sensible. Use a real checkpoint for real work.

Everything here is deterministic: the same ``vocab_size`` gives byte-identical tokenizer files and the same
``seed`` gives a byte-identical checkpoint. ``transformers`` is deliberately not imported: the runtime must
not need it (tests check the checkpoint loads in transformers' ``LlamaForCausalLM``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Bump when anything that changes the written files changes, so stale caches are never reused.
DEMO_VERSION = "v1"

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Order fixes the ids: specials come first (0..4), then the 256 byte symbols, then the merges.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START, IM_END, PAD_TOKEN)
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

MODEL_MAX_LENGTH = 2048

# ChatML with a leading bos. The rendered text already carries bos, so encoding it adds no second one
# (HF convention: encode chat text with add_special_tokens=False; deepinfer's Tokenizer never doubles it).
CHATML_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

DEMO_ARCH = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "max_position_embeddings": MODEL_MAX_LENGTH,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
INIT_STD = 0.02


def _corpus_paragraphs() -> list[str]:
    corpus = resources.files("deepinfer.engine.models").joinpath("data/demo_corpus.txt")
    text = corpus.read_text(encoding="utf-8")
    return [p for p in text.split("\n\n") if p.strip()]


def _write_json(path: Path, obj: dict) -> None:
    # Sorted keys + fixed separators: the bytes depend only on the content.
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def train_demo_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Train the byte-level BPE tokenizer on the shipped corpus (deterministic; ~tens of ms)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size}: must be >= {MIN_VOCAB_SIZE} (256 byte symbols + "
            f"{len(SPECIAL_TOKENS)} special tokens)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_paragraphs(), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    # Llama-3 style: the post-processor prepends bos when special tokens are requested.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tok


def write_tokenizer_files(path: str | Path, vocab_size: int = 512) -> int:
    """Write tokenizer.json and tokenizer_config.json for the demo tokenizer into ``path``.

    Deterministic (same ``vocab_size`` => byte-identical files) and idempotent (overwrites). Special tokens:
    ``<|begin_of_text|>`` (bos, id 0), ``<|end_of_text|>`` (eos, id 1), ``<|im_start|>`` (2),
    ``<|im_end|>`` (3), ``<|pad|>`` (4). The config carries a ChatML ``chat_template``. Returns the vocab
    size including specials.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_demo_tokenizer(vocab_size)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    _write_json(
        out / "tokenizer_config.json",
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": BOS_TOKEN,
            "chat_template": CHATML_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": EOS_TOKEN,
            "model_max_length": MODEL_MAX_LENGTH,
            "pad_token": PAD_TOKEN,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    return tok.get_vocab_size(with_added_tokens=True)


def demo_config(vocab_size: int, bos_id: int, eos_id: int, pad_id: int) -> dict:
    """The config.json contents of the demo checkpoint (HF LlamaForCausalLM layout)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        **DEMO_ARCH,
        "head_dim": DEMO_ARCH["hidden_size"] // DEMO_ARCH["num_attention_heads"],
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "initializer_range": INIT_STD,
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "use_cache": True,
    }


def demo_state_dict(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random Llama weights under HF parameter names: normal(0, 0.02) matrices, RMSNorm weights of ones."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * INIT_STD

    # Insertion order fixes the generator draw order, hence the exact values.
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(vocab, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = rand(q_out, h)
        sd[p + "self_attn.k_proj.weight"] = rand(kv_out, h)
        sd[p + "self_attn.v_proj.weight"] = rand(kv_out, h)
        sd[p + "self_attn.o_proj.weight"] = rand(h, q_out)
        sd[p + "mlp.gate_proj.weight"] = rand(inter, h)
        sd[p + "mlp.up_proj.weight"] = rand(inter, h)
        sd[p + "mlp.down_proj.weight"] = rand(h, inter)
        sd[p + "input_layernorm.weight"] = torch.ones(h)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h)
    sd["model.norm.weight"] = torch.ones(h)
    sd["lm_head.weight"] = rand(vocab, h)
    return sd


def _build(target: Path, seed: int) -> None:
    vocab_size = write_tokenizer_files(target)
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    bos, eos, im_end, pad = (tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, IM_END, PAD_TOKEN))
    config = demo_config(vocab_size, bos, eos, pad)
    _write_json(target / "config.json", config)
    # Chat turns end with <|im_end|>, so generation stops on it as well as on eos.
    _write_json(
        target / "generation_config.json",
        {"bos_token_id": bos, "eos_token_id": [eos, im_end], "pad_token_id": pad},
    )
    save_file(demo_state_dict(config, seed), str(target / "model.safetensors"), metadata={"format": "pt"})


_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                   "tokenizer_config.json")


def _is_complete(d: Path) -> bool:
    return all((d / name).is_file() for name in _REQUIRED_FILES)


def default_cache_dir() -> Path:
    """``$DEEPINFER_CACHE_DIR`` when set, else ``~/.cache/deepinfer``."""
    env = os.environ.get("DEEPINFER_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "deepinfer"


def demo_model_dir(cache_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Return the directory of the demo checkpoint for ``seed``, building it once if needed.

    The directory is ``<cache_dir>/demo-llama-<version>-<seed>`` (``cache_dir`` defaults to
    ``default_cache_dir()``). It is built in a temporary directory beside it and moved into place with one
    ``os.replace``, so concurrent processes never see a half-built directory; when two build at once, one
    wins and the other discards its copy (both copies are byte-identical anyway). The model's output text is
    meaningless: the weights are random.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed={seed!r}: must be a non-negative int")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"demo-llama-{DEMO_VERSION}-{seed}"
    if _is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        _build(tmp, seed)
        if final.exists() and not _is_complete(final):
            # Left by something other than this function (it only ever moves complete dirs into place).
            stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.stale-", dir=root))
            os.replace(final, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not _is_complete(final):  # not a lost race: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
