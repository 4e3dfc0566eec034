"""Bringing the MTP draft up beside the target: which models qualify, its weights, its share of the KV cache.

The target's loader skips the MTP layers; `MTPLoader.collect` keeps them (only the first MTP layer's) as the
weights stream by, so the checkpoint is read once. Whatever is missing turns MTP off with a warning, never an
error: drafting can only ever change speed, so running without it is always correct.

The draft's KV cache is one more layer in the model's own cache layout (MLA: `num_layers` grows by one; V4:
one more sliding-window layer, `V4CacheSpec.with_draft_layer`): the same blocks, slots, block tables,
prefix-cache hits and preemptions serve the target layers and the MTP layer alike. DeepSeek-V4 checkpoints
(`mtp.K.*`, engine/spec_decode/v4_mtp_model.py) go through `V4MTPLoader`, DeepSeek-V3's through `MTPLoader`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from deepinfer.engine.layers.v4_cache import V4CacheSpec
from deepinfer.engine.models.config import ModelConfig
from deepinfer.engine.models.deepseek import DeepseekForCausalLM
from deepinfer.engine.models.deepseek_config import DEEPSEEK_V3, DeepseekConfig
from deepinfer.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.engine.models.deepseek_v4_config import DeepseekV4Config
from deepinfer.engine.spec_decode.config import MTP_ENV, MTPConfig, resolve_mtp_option
from deepinfer.engine.spec_decode.mtp_model import _OWN_EMBED, _OWN_HEAD, MTPDraftModel, mtp_layer_index
from deepinfer.engine.spec_decode.v4_mtp_model import V4MTPLoader

logger = logging.getLogger("deepinfer.engine")


class MTPLoader:
    """Collects the MTP layer's tensors from the target's weight stream, then builds the draft."""

    def __init__(self, cfg: MTPConfig, model: DeepseekForCausalLM) -> None:
        self.cfg = cfg
        self.model = model
        self.layer = model.config.num_hidden_layers
        self.tensors: dict[str, torch.Tensor] = {}

    @classmethod
    def for_model(cls, option: bool | MTPConfig | None, mc: ModelConfig, model: Any
                  ) -> MTPLoader | V4MTPLoader | None:
        """A loader when MTP is asked for (option, else $DEEPINFER_ENABLE_MTP_VARLEN) and `model` can draft
        with it; None otherwise, with a warning when it was asked for but cannot be had."""
        cfg = resolve_mtp_option(option)
        if cfg is None:
            return None
        if isinstance(mc, DeepseekV4Config):
            return _v4_loader(cfg, mc, model)
        if not isinstance(mc, DeepseekConfig):
            _off(f"MTP drafting is built for DeepSeek-V3-architecture checkpoints; {mc.architecture} is not "
                 "one (no multi-token-prediction layers here)")
            return None
        if not isinstance(model, DeepseekForCausalLM):
            _off(f"the draft runs beside a single-device {mc.architecture} model only, not beside "
                 f"{type(model).__name__} (e.g. tensor parallel)")
            return None
        if mc.num_mtp_layers < 1:
            _off(f"the checkpoint's config counts no MTP layers (num_nextn_predict_layers=0, "
                 f"{mc.architecture}"
                 f"{'' if mc.architecture == DEEPSEEK_V3 else '; DeepSeek-V2 has none'})")
            return None
        return cls(cfg, model)

    def collect(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass every tensor on (the target's loader skips MTP layers) and keep the first MTP layer's."""
        prefix = f"model.layers.{self.layer}."
        for name, tensor in weights:
            if mtp_layer_index(name, self.layer) == self.layer:
                self.tensors[name.removeprefix(prefix)] = tensor
            yield name, tensor

    def build(self, dummy_seed: int | None = None, quant_plan: Any = None) -> MTPDraftModel | None:
        """The loaded draft (or seeded random weights with `dummy_seed`); None, with a warning, when the
        checkpoint's MTP layer is absent or incomplete. A block-FP8 checkpoint's MTP layer (`quant_plan` with
        a checkpoint format, models/quant/) is dequantized to the model dtype as it loads."""
        if dummy_seed is not None:
            draft = MTPDraftModel(self.model, own_embed=False, own_head=False).eval()
            draft.init_dummy_weights(dummy_seed)
            return draft
        if not self.tensors:
            _off(f"the checkpoint holds no tensors of its MTP layer (model.layers.{self.layer}.*)")
            return None
        draft = MTPDraftModel(self.model, own_embed=_OWN_EMBED in self.tensors,
                              own_head=_OWN_HEAD in self.tensors).eval()
        prefix = f"model.layers.{self.layer}."
        stream: Iterable[tuple[str, torch.Tensor]] = ((prefix + k, v) for k, v in self.tensors.items())
        if quant_plan is not None and quant_plan.checkpoint is not None:
            from deepinfer.engine.models.quant.fp8_loading import fp8_weight_stream

            stream = fp8_weight_stream(stream, quant_plan)   # no FP8 modules in the draft: all dequantized
        try:
            draft.load_weights(stream)
        except ValueError as e:
            _off(f"its MTP layer does not load ({e})")
            return None
        finally:
            self.tensors.clear()
        return draft


def attach_draft_cache(spec: Any) -> Any:
    """The model's cache layout with the draft's layer added as its last layer: same blocks, slots and block
    tables; each block simply holds one more layer (MLA's latent; V4's sliding rows, `with_draft_layer`)."""
    if isinstance(spec, V4CacheSpec):
        return spec.with_draft_layer()
    return dataclasses.replace(spec, num_layers=spec.num_layers + 1)


def _v4_loader(cfg: MTPConfig, mc: DeepseekV4Config, model: Any) -> V4MTPLoader | None:
    if not isinstance(model, DeepseekV4ForCausalLM):
        _off(f"the draft runs beside a single-device {mc.architecture} model only, not beside "
             f"{type(model).__name__}")
        return None
    if mc.num_mtp_layers < 1:
        _off(f"the checkpoint's config counts no MTP layers (num_nextn_predict_layers=0, {mc.architecture})")
        return None
    return V4MTPLoader(cfg, model)


def _off(why: str) -> None:
    logger.warning("MTP speculative decoding was asked for (speculative_mtp / $%s) but stays off: %s. "
                   "Outputs are unaffected.", MTP_ENV, why)
