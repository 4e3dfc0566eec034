"""A test driver for deepinfer models: paged KV cache, block tables and flattened varlen batches."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import torch
from deepinfer.engine.models.config import ModelConfig
from deepinfer.kernels.metadata import AttentionMetadata

BLOCK_SIZE = 16
NUM_BLOCKS = 48


@dataclass
class _Seq:
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0


class PagedBatchRunner:
    """Drives a deepinfer model the way the engine does: block tables, slot mapping, flattened batches."""

    def __init__(self, model, cfg: ModelConfig, num_blocks: int = NUM_BLOCKS) -> None:
        self.model, self.cfg = model, cfg
        param = next(model.parameters())
        self.device = param.device
        shape = (num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        # NaN-filled: attention must never let an unwritten or masked slot reach a result.
        if hasattr(model, "kv_cache_spec"):  # a model with its own cache layout (e.g. MLA's latent cache)
            spec = model.kv_cache_spec(BLOCK_SIZE, param.dtype)
            caches = model.allocate_kv_cache(spec, num_blocks, self.device)
            # One tensor per layer (MLA's latent), or a (k, v) pair (a tensor-parallel shard's own heads).
            nan = float("nan")
            self.kv = [tuple(t.fill_(nan) for t in c) if isinstance(c, tuple) else c.fill_(nan)
                       for c in caches]
        else:
            self.kv = [tuple(torch.full(shape, float("nan"), dtype=param.dtype, device=self.device)
                             for _ in range(2)) for _ in range(cfg.num_hidden_layers)]
        # Hand blocks out in a scrambled order so that block tables are not the identity.
        self.free = random.Random(0).sample(range(num_blocks), num_blocks)
        self.seqs: dict[str, _Seq] = {}

    def add(self, key: str, tokens: list[int]) -> None:
        self.seqs[key] = _Seq(list(tokens))

    def append(self, key: str, token: int) -> None:
        self.seqs[key].tokens.append(token)

    def step(self, work: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
        """Compute the next `n` uncomputed tokens of each (key, n); return each sequence's logits [n, V]."""
        ids, pos, slots, qlens, slens, tables = [], [], [], [], [], []
        for key, n in work:
            s = self.seqs[key]
            start, end = s.computed, s.computed + n
            assert end <= len(s.tokens)
            while len(s.blocks) * BLOCK_SIZE < end:
                s.blocks.append(self.free.pop())
            ids += s.tokens[start:end]
            pos += list(range(start, end))
            slots += [s.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            qlens.append(n)
            slens.append(end)
            tables.append(list(s.blocks))
            s.computed = end
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        qsl = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
        positions = torch.tensor(pos, dtype=torch.int64)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64), positions=positions, query_start_loc=qsl,
            seq_lens=torch.tensor(slens, dtype=torch.int32), block_tables=table, block_size=BLOCK_SIZE,
            max_query_len=max(qlens), max_seq_len=max(slens), query_lens_cpu=qlens, seq_lens_cpu=slens,
        )
        meta = _to_device(meta, self.device)
        with torch.inference_mode():
            ids_t = torch.tensor(ids, dtype=torch.int64, device=self.device)
            hidden = self.model(ids_t, meta.positions, meta, self.kv)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return dict(zip([k for k, _ in work], logits.split(qlens)))


def two_prompt_logits(model, cfg: ModelConfig, decode_steps: int = 3) -> list[torch.Tensor]:
    """Two prompts (7 and 4 tokens) prefilled together, then `decode_steps` greedy decode steps of both:
    every step's logits, in order (what the wiring tests compare bit for bit between two builds)."""
    runner = PagedBatchRunner(model, cfg)
    runner.add("a", [5, 17, 3, 40, 22, 9, 31])
    runner.add("b", [8, 2, 61, 14])
    out = runner.step([("a", 7), ("b", 4)])
    steps = [out["a"], out["b"]]
    for _ in range(decode_steps):
        for key in ("a", "b"):
            runner.append(key, int(out[key][-1].argmax()))
        out = runner.step([("a", 1), ("b", 1)])
        steps += [out["a"], out["b"]]
    return steps


def _to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(meta).items()}
    return AttentionMetadata(**fields)


def prefill_rel_error(model, reference, cfg: ModelConfig, ids: list[int]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill `ids` through `model` and `reference`: (model's logits [len(ids), V], each position's max
    absolute error relative to the reference's largest logit) — how the FP8 tests bound a quantized model."""
    logits = []
    for m in (model, reference):
        runner = PagedBatchRunner(m, cfg)
        runner.add("a", ids)
        logits.append(runner.step([("a", len(ids))])["a"])
    got, want = logits
    return got, (got - want).abs().amax(dim=1) / want.abs().max()


def check_cuda_ops_against_transformers(path, a: list[int], b: list[int], first: int) -> ModelConfig:
    """The checkpoint at `path` built on the CUDA backend's ops (`CudaInvariantOps`, float32 on the CPU:
    the Triton kernels under the interpreter) runs the first `first` tokens of prompt `a` beside all of `b`,
    then the rest of `a`, then one decode step of each; every step's logits match transformers' (1e-4).
    Returns the model config."""
    from deepinfer.engine.layers.cuda_ops import CudaInvariantOps
    from deepinfer.engine.models.loader import iter_weights
    from deepinfer.engine.models.registry import build_model
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig.from_dir(path)
    model = build_model(cfg, CudaInvariantOps(), torch.float32, "cpu")
    model.load_weights(iter_weights(path, "cpu"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = PagedBatchRunner(model, cfg)
    runner.add("a", a)
    runner.add("b", b)
    steps = [runner.step([("a", first), ("b", len(b))]), runner.step([("a", len(a) - first)])]
    runner.append("a", 7)
    runner.append("b", 8)
    steps.append(runner.step([("b", 1), ("a", 1)]))
    with torch.no_grad():
        for key, prompt, nxt in (("a", a, 7), ("b", b, 8)):
            ref = hf(torch.tensor([prompt + [nxt]])).logits[0]
            got = torch.cat([s[key] for s in steps if key in s])
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    return cfg
