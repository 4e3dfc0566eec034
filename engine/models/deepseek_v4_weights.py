"""Map DeepSeek-V4 checkpoint tensors onto the model's parameters; seeded dummy weights.

Names are accepted in transformers' in-memory spelling (`model.layers.N.self_attn.q_a_proj.weight`,
fused `mlp.experts.gate_up_proj`) and in DeepSeek's own, which is also what transformers' save_pretrained
writes for V4 (`layers.N.attn.wq_a.weight`, `ffn.experts.E.w1.weight`, `attn_sink`, `hc_attn_fn`,
`compressor.ape`, `indexer.compressor.*`, `embed.weight`, `head.weight`, with or without `model.`).
`RENAMES` translates the second into the first, in order. Per-expert w1 / w3 / w2 fill the fused
`gate_up_proj` (gate rows, then up rows) and `down_proj`; shared-expert w1 / w3 fill `gate_up_proj`.
MTP modules (`mtp.K.*`, or `model.layers.{L + K}.*`) are kept aside, unmodified, in `model.mtp_weights`.
FP8 / FP4 scale tensors are refused with what to do.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from deepinfer.engine.layers.v4_norm import V4RMSNorm
from deepinfer.engine.models.weights import init_dummy_weights
from torch import nn

# (pattern, replacement) applied in order to a name without its "model." prefix.
RENAMES: tuple[tuple[str, str], ...] = (
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.(shared_experts|experts\.\d+)\.w1\.", r".\1.gate_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w3\.", r".\1.up_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w2\.", r".\1.down_proj."),
)
_RENAMES = tuple((re.compile(p), r) for p, r in RENAMES)
_IGNORED = re.compile(r"(^|\.)rotary_emb\.")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
_SHARED = re.compile(r"^(model\.layers\.\d+\.mlp\.shared_experts\.)(gate|up)_proj\.weight$")
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def canonical_name(name: str) -> str:
    """transformers' in-memory name of a checkpoint tensor name (either spelling)."""
    n = name[len("model.") :] if name.startswith("model.") else name
    for pattern, repl in _RENAMES:
        n = pattern.sub(repl, n)
    return n if n == "lm_head.weight" else f"model.{n}"


def _is_mtp(name: str, num_layers: int) -> bool:
    if name.startswith(("mtp.", "model.mtp.")):
        return True
    m = _LAYER.match(name)
    return bool(m) and int(m.group(1)) >= num_layers


@torch.no_grad()
def load_v4_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy (name, tensor) pairs into a DeepseekV4ForCausalLM; ValueError for a tensor with no place, a shape
    mismatch, a quantisation scale, or parameters the checkpoint did not provide."""
    cfg = model.config
    targets: dict[str, torch.Tensor] = dict(model.named_parameters())
    targets.update((n, b) for n, b in model.named_buffers() if n.endswith(".tid2eid"))
    needed: set[tuple[str, object]] = set()
    for pname, t in targets.items():
        if pname.endswith(".experts.gate_up_proj"):
            needed.update((pname, (e, s)) for e in range(t.shape[0]) for s in ("gate", "up"))
        elif pname.endswith(".experts.down_proj"):
            needed.update((pname, (e, "down")) for e in range(t.shape[0]))
        elif pname.endswith(".shared_experts.gate_up_proj.weight"):
            needed.update({(pname, "gate"), (pname, "up")})
        else:
            needed.add((pname, None))
    if cfg.tie_word_embeddings:
        needed.discard(("lm_head.weight", None))
    loaded: set[tuple[str, object]] = set()
    device = next(model.parameters()).device
    for name, tensor in weights:
        if _IGNORED.search(name):
            continue
        if _is_mtp(name, cfg.num_hidden_layers):
            model.mtp_weights[name] = tensor.to(device)
            continue
        cname = canonical_name(name)
        if cfg.tie_word_embeddings and cname == "lm_head.weight":
            continue
        dest, shard, pname = _destination(cname, targets)
        if dest is None:
            if name.endswith(("scale_inv", ".scale")):
                raise ValueError(
                    f"checkpoint tensor {name!r}: quantised (FP8/FP4 block-scaled) checkpoints are "
                    "not supported; convert the weights to bfloat16 first"
                )
            raise ValueError(
                f"checkpoint tensor {name!r} has no matching parameter in DeepseekV4ForCausalLM "
                "(does config.json match the weights?)"
            )
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(dest.shape)} (does config.json match the weights?)"
            )
        dest.copy_(tensor)
        if shard == "fused":
            loaded.update(k for k in needed if k[0] == pname)
        else:
            loaded.add((pname, shard))
    missing = sorted(p if s is None else f"{p}[{s}]" for p, s in needed - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint lacks weights for: {shown}")


def _destination(cname: str, targets: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, object, str]:
    """(the view to copy into, which shard of its parameter it covers, the parameter's name)."""
    if m := _EXPERT.match(cname):
        prefix, e, part = m.group(1), int(m.group(2)), m.group(3)
        pname = prefix + ("down_proj" if part == "down" else "gate_up_proj")
        p = targets.get(pname)
        if p is None or e >= p.shape[0]:
            return None, None, pname
        if part == "down":
            return p[e], (e, "down"), pname
        half = p.shape[1] // 2
        return (p[e, :half] if part == "gate" else p[e, half:]), (e, part), pname
    if m := _SHARED.match(cname):
        pname = f"{m.group(1)}gate_up_proj.weight"
        p = targets.get(pname)
        if p is None:
            return None, None, pname
        half = p.shape[0] // 2
        return (p[:half] if m.group(2) == "gate" else p[half:]), m.group(2), pname
    if cname.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        p = targets.get(cname)
        return p, "fused", cname
    p = targets.get(cname)
    return p, None, cname


@torch.no_grad()
def init_v4_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Seeded random weights shaped for benchmarks: norms 1, hyper-connection scales 1 and biases 0, sinks,
    position biases and router correction biases 0, a random token -> experts table per hash layer."""
    init_dummy_weights(model, seed)
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, V4RMSNorm):
            m.weight.fill_(1.0)
    for name, p in model.named_parameters():
        if name.endswith((".base", "hc_base", ".sinks", ".position_bias", ".e_score_correction_bias")):
            p.zero_()
        elif name.endswith((".scale", "hc_scale")):
            p.fill_(1.0)
    cfg = model.config
    for name, b in model.named_buffers():
        if name.endswith(".tid2eid"):
            # Distinct experts per token, as a real table has them.
            ids = torch.rand(b.shape[0], cfg.n_routed_experts, generator=gen).argsort(dim=1)[:, : b.shape[1]]
            b.copy_(ids)
