"""The public engine API: `LLM(model=...)`, `LLM.generate`, `LLM.chat` (contract in DESIGN.md)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from collections.abc import Sequence as SeqType
from typing import TYPE_CHECKING

import torch
from deepinfer.engine.core.config import CacheConfig, SchedulerConfig
from deepinfer.engine.core.engine_core import EngineCore
from deepinfer.engine.core.finish import FinishRules
from deepinfer.engine.core.gc_scope import quiet_gc
from deepinfer.engine.core.kv_cache import (
    KVCacheSpec,
    allocate_kv_cache_for,
    blocks_that_fit,
    cache_layout_for,
)
from deepinfer.engine.core.request_feed import FEED_CHUNK, QUEUE_ALL_ENV, RequestFeed
from deepinfer.engine.core.scheduler import Scheduler
from deepinfer.engine.core.sequence import Sequence
from deepinfer.engine.core.window_blocks import make_block_manager
from deepinfer.engine.layers.backends import make_ops
from deepinfer.engine.models.config import ModelConfig
from deepinfer.engine.models.loader import iter_weights, resolve_dtype, resolve_model_dir
from deepinfer.engine.models.quant.fp8_format import plan_quantization, read_checkpoint_format
from deepinfer.engine.models.quant.fp8_loading import init_dummy_with_plan, load_with_plan
from deepinfer.engine.models.quant.kv_fp8 import check_kv_layout, kv_cache_torch_dtype
from deepinfer.engine.models.registry import build_model
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.parallel.setup import check_tensor_parallel_size, tensor_parallel_model
from deepinfer.engine.runner.cuda_graphs import capture_mode, env_flag, make_decode_graphs
from deepinfer.engine.runner.model_runner import ModelRunner
from deepinfer.engine.runner.numerics_stack import numerics_stack
from deepinfer.engine.runner.prefill_graphs import make_prefill_graphs
from deepinfer.engine.runner.step_executor import StepExecutor
from deepinfer.engine.sample.params import SamplingParams
from deepinfer.engine.sample.rng import request_seed, sample_seed
from deepinfer.engine.sample.seed_batch import fingerprint_parts, request_seeds
from deepinfer.engine.spec_decode.config import MTPConfig
from deepinfer.engine.spec_decode.setup import MTPLoader, attach_draft_cache
from deepinfer.engine.spec_decode.step import SpecDecoder
from deepinfer.engine.structured.lazy import LazyStructuredOutputs
from deepinfer.engine.text.output_processor import OutputProcessor
from deepinfer.engine.text.prompts import prompt_items
from deepinfer.engine.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from deepinfer.engine.structured.manager import StructuredOutputManager

_DEVICES = ("auto", "cuda", "cpu")


def _resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not device.startswith(("cuda", "cpu")):
        raise ValueError(f"device={device!r}: expected one of {_DEVICES} (or 'cuda:N')")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine; use device='cpu'")
    return torch.device(device)


class LLM:
    """An offline engine over one model replica.

    With `deterministic=True` (the default) every numeric op is batch-invariant and sampling draws
    from a counter-based generator keyed by (request seed, output position), so a request's tokens
    depend only on its prompt, its parameters and its seed — not on what else is in the batch,
    the scheduling, chunked prefill, preemption or prefix-cache hits.
    """

    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        device: str | torch.device = "auto",
        deterministic: bool = True,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float = 0.90,
        cpu_kv_cache_gib: float = 1.0,
        seed: int = 0,
        load_format: str = "auto",
        allow_pickle: bool = False,
        enable_cuda_graphs: bool = True,
        cuda_graph_capture: str | None = None,
        async_scheduling: bool = True,
        quantization: str | None = "auto",
        kv_cache_dtype: str = "auto",
        speculative_mtp: bool | MTPConfig | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        """enable_cuda_graphs: capture decode steps as CUDA graphs (CUDA only; off with
        DEEPINFER_DISABLE_CUDA_GRAPHS=1; prefill and mixed steps of the dense decoders too, unless
        DEEPINFER_DISABLE_PREFILL_GRAPHS=1, runner/prefill_graphs.py); cuda_graph_capture: "startup" (every
        batch-size bucket before the first step) or "lazy" (each bucket on its first use), None reads
        DEEPINFER_CUDA_GRAPH_CAPTURE (default "startup"); the same bits either way. async_scheduling: overlap
        host work with the device step (core/overlap.py; off with DEEPINFER_SYNC_LOOP=1). Neither changes an
        output in deterministic mode.
        quantization: None (model dtype; FP8 checkpoints dequantized), "auto" (FP8 GEMMs for an FP8
        checkpoint on CUDA), "fp8" (also quantizes a bf16 checkpoint at load, 128x128 blocks) or
        "fp8-channel" (quantizes at load per output channel: the rowwise FP8 GEMM); see models/quant/.
        kv_cache_dtype: "auto" (the model dtype) or "fp8" (e4m3 with per-head scales; about twice the
        sequences fit). speculative_mtp: draft with a DeepSeek checkpoint's MTP layer and verify exactly
        (engine/spec_decode/; same output bytes): True / an MTPConfig turns it on, False off, None reads
        DEEPINFER_ENABLE_MTP_VARLEN=1. Models without an MTP layer run without it (a warning says why).
        tensor_parallel_size: shard the model over N devices (rank 0 here, ranks 1..N-1 in worker
        processes; engine/parallel/); decode steps then run without CUDA graphs."""
        if cuda_graph_capture is not None:
            capture_mode(cuda_graph_capture)   # a bad value fails here, also where graphs never run
        # Construction phases (time.time() epochs) for a caller's start-up report (the job pipeline's
        # run summary): parameters allocated (CUDA's context started), weights loaded, KV cache allocated.
        self.startup_marks: dict[str, float] = {}
        self.device = _resolve_device(device)
        self.model_dir = resolve_model_dir(model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.dtype = resolve_dtype(dtype, self.model_config)
        self.deterministic = deterministic
        self.seed = seed
        mc = self.model_config
        if max_model_len is None:
            max_model_len = mc.max_position_embeddings
            if mc.sliding_window is not None:
                # Attention here is always full: stay within the window the model was trained with.
                max_model_len = min(max_model_len, mc.sliding_window)
        elif max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{mc.max_position_embeddings}"
            )
        elif mc.sliding_window is not None and max_model_len > mc.sliding_window:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's sliding_window={mc.sliding_window}; "
                "deepinfer attends over the full context, so keep max_model_len within the window"
            )
        self.sched_cfg = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or max(8192, min(max_model_len, 16384)),
            max_model_len=max_model_len,
        )
        cache_cfg = CacheConfig(
            block_size=block_size, num_blocks=num_kv_blocks, gpu_memory_utilization=gpu_memory_utilization,
            cpu_kv_cache_gib=cpu_kv_cache_gib, enable_prefix_caching=enable_prefix_caching,
        )
        ops = make_ops(self.device, deterministic)
        self.quant_plan = plan_quantization(quantization, read_checkpoint_format(self.model_dir),
                                            self.device.type)
        kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, self.dtype)
        if check_tensor_parallel_size(tensor_parallel_size) == 1:
            self.model = build_model(mc, ops, self.dtype, self.device, max_model_len=max_model_len)
        else:
            self.model = tensor_parallel_model(
                tensor_parallel_size, model_dir=self.model_dir, dtype=self.dtype, device=self.device,
                deterministic=deterministic, max_model_len=max_model_len, allow_pickle=allow_pickle,
                quant_plan=self.quant_plan)
        self.startup_marks["allocated"] = time.time()
        mtp = MTPLoader.for_model(speculative_mtp, mc, self.model)   # None unless asked for and possible
        if load_format == "dummy":
            init_dummy_with_plan(self.model, self.quant_plan, seed)
        elif load_format == "auto":
            weights = iter_weights(self.model_dir, self.device, allow_pickle=allow_pickle)
            load_with_plan(self.model, mtp.collect(weights) if mtp else weights, self.quant_plan)
        else:
            raise ValueError(f"load_format={load_format!r}: expected 'auto' or 'dummy'")
        self.startup_marks["weights_loaded"] = time.time()
        spec = KVCacheSpec(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, block_size, kv_dtype)
        check_kv_layout(self.model, kv_dtype)
        # A model may keep its own cache layout (MLA: one latent per token and layer); Llama keeps K/V.
        configure = getattr(self.model, "configure_kv_cache", None)
        if configure is not None:   # DeepSeek-V4: bounded window cache unless prefix caching needs all tokens
            configure(enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len)
        spec = self.kv_cache_spec = cache_layout_for(self.model, spec)
        draft = mtp.build(seed + 1 if load_format == "dummy" else None, self.quant_plan) if mtp else None
        if draft is not None:   # the draft's latent layer joins the cache layout: same blocks and slots
            spec = self.kv_cache_spec = attach_draft_cache(spec)
        n_blocks = blocks_that_fit(spec, cache_cfg, self.device)
        self.cache_cfg = dataclasses.replace(cache_cfg, num_blocks=n_blocks)
        kv_caches = allocate_kv_cache_for(self.model, spec, n_blocks, self.device)
        draft_cache = kv_caches.pop() if draft is not None else None
        self.startup_marks["kv_allocated"] = time.time()
        # One handle for the engine core, the runner and the finish rules; the manager behind it is built on
        # the first constrained request (compiling the vocabulary for llguidance costs time).
        self._structured = LazyStructuredOutputs(
            self.model_dir / "tokenizer.json", mc.vocab_size, self.eos_token_ids, max_model_len=max_model_len,
        )
        block_manager = make_block_manager(spec, n_blocks, block_size, enable_prefix_caching)
        finish_rules = FinishRules(max_model_len, self._structured)
        scheduler = Scheduler(self.sched_cfg, self.cache_cfg, block_manager, finish_rules)
        runner = ModelRunner(self.model, kv_caches, block_size, mc.vocab_size, self.device, self._structured)
        graphs = make_decode_graphs(self.model, kv_caches, block_size, max_model_len, max_num_seqs,
                                    self.device, enable_cuda_graphs and tensor_parallel_size == 1,
                                    cuda_graph_capture)
        prefill_graphs = make_prefill_graphs(self.model, kv_caches, block_size, max_model_len, max_num_seqs,
                                             self.sched_cfg.max_num_batched_tokens, self.device,
                                             enable_cuda_graphs and tensor_parallel_size == 1)
        spec_decoder = (SpecDecoder(mtp.cfg, draft, draft_cache, scheduler, runner)
                        if mtp is not None and draft is not None else None)
        self.engine = EngineCore(scheduler, runner, OutputProcessor(self.tokenizer), self._structured,
                                 executor=StepExecutor(runner, graphs, prefill_graphs),
                                 async_scheduling=async_scheduling and not env_flag("DEEPINFER_SYNC_LOOP"),
                                 spec=spec_decoder)
        self._ids = itertools.count()

    @property
    def structured(self) -> StructuredOutputManager:
        """The structured-output manager (built now if no constrained request has needed it yet)."""
        return self._structured.manager

    @property
    def numerics_stack(self) -> str:
        """The stack this engine computes with (runner/numerics_stack.py): same line, same output bits."""
        return numerics_stack(self.device)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.model_config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)

    def get_stats(self) -> dict[str, float | int | bool | str | list[int] | None]:
        """Engine counters: loop mode, steps, CUDA-graph buckets, capture time and memory, spec decoding."""
        return self.engine.stats()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    # ---- requests -------------------------------------------------------------------------------
    def _check_request(self, index: int, prompt_ids: list[int], params: SamplingParams) -> None:
        """ValueError naming request `index` when it can never run here: an empty or too long prompt, a
        token id outside the vocabulary, a grammar that does not compile, a prompt and output cap the KV
        cache cannot hold."""
        n = len(prompt_ids)
        if n == 0:
            raise ValueError(f"prompt {index} is empty")
        limit = self.sched_cfg.max_model_len
        if n >= limit:
            raise ValueError(
                f"prompt {index} has {n} tokens; max_model_len={limit} leaves no room to generate "
                f"(shorten the prompt or raise max_model_len)"
            )
        vocab = self.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            bad = next(t for t in prompt_ids if not 0 <= t < vocab)
            raise ValueError(f"prompt {index} holds token id {bad}, outside the vocabulary [0, {vocab})")
        self._structured.validate(params)  # compiles a constrained request's grammar; no-op otherwise
        problem = self.engine.scheduler.refusal(n, params.max_tokens)
        if problem is not None:
            raise ValueError(f"prompt {index}: {problem}")

    def _make_seqs(self, index: int, prompt_ids: list[int], params: SamplingParams,
                   seed: int | None = None, checked: bool = False) -> list[Sequence]:
        """The request's n sequences (sample i seeded by rng.sample_seed(row seed, i)); ValueError names
        the request when it cannot run. `seed`: the row seed when the caller derived it already (it must be
        `params.seed` or `request_seed`'s). `checked`: `_check_request` passed already."""
        if not checked:
            self._check_request(index, prompt_ids, params)
        if seed is None:
            seed = request_seed(self.seed, prompt_ids, params)
        n = len(prompt_ids)
        seqs: list[Sequence] = []
        for i in range(params.n):
            seqs.append(Sequence(
                seq_id=next(self._ids), prompt_token_ids=list(prompt_ids), params=params,
                seed=sample_seed(seed, i), eos_token_ids=self.eos_token_ids, sample_index=i,
                leader=seqs[0] if seqs else None,
                # Prompt logprobs are the same for every sample: only sample 0 computes them.
                prompt_logprobs=[None] * n if params.prompt_logprobs is not None and i == 0 else None,
            ))
        return seqs

    def _make_seq(self, index: int, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """The one sequence of an n=1 request (for callers that feed the engine core directly)."""
        if params.n != 1:
            raise ValueError(f"_make_seq: request {index} asks for n={params.n} samples; use _make_seqs")
        return self._make_seqs(index, prompt_ids, params)[0]

    def generate(
        self,
        prompts: str | dict | list[str] | list[list[int]] | list[dict],
        sampling_params: SamplingParams | SeqType[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}
        dicts); outputs come back in prompt order, each with `SamplingParams.n` completions.

        Sample 0 of a request draws from the request's seed (given, or derived from the prompt and the
        parameters), so it is the n=1 output; sample i > 0 from `rng.sample_seed(seed, i)`. Samples share
        the prompt's KV blocks through the prefix cache. Every request is validated before any is run: a
        bad one raises ValueError naming its index and leaves the engine ready for the next call.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        # The collector kept quiet from here, not only in the engine's run: building 256 requests allocates
        # enough to set off a full collection (133 ms measured on the H200 host) before the first step.
        with quiet_gc():
            texts, token_lists = prompt_items(prompts, self.tokenizer)
            for i, (ids, sp) in enumerate(zip(token_lists, params_list)):
                self._check_request(i, ids, sp)
            fingerprints = fingerprint_parts(params_list)   # refuses a params no seed derives from, now

            def build(first: int, stop: int) -> list[list[Sequence]]:
                # Seeds and sequences a chunk at a time, as the engine loop asks (core/request_feed.py).
                seeds = request_seeds(self.seed, token_lists[first:stop], params_list[first:stop],
                                      fingerprints)
                return [self._make_seqs(i, token_lists[i], params_list[i], seed, checked=True)
                        for i, seed in zip(range(first, stop), seeds)]

            return self._run(build, [sp.n for sp in params_list], texts, use_tqdm)

    def chat(
        self,
        messages: list[list[dict]] | list[dict],
        sampling_params: SamplingParams | SeqType[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]  # a single conversation
        prompts = [self.tokenizer.apply_chat_template(m, add_generation_prompt=add_generation_prompt)
                   for m in messages]
        token_lists = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outs = self.generate(token_lists, sampling_params, use_tqdm=use_tqdm)
        for o, p in zip(outs, prompts):
            o.prompt = p
        return outs

    def _run(self, build: Callable[[int, int], list[list[Sequence]]], samples: list[int],
             texts: list[str | None], use_tqdm: bool) -> list[RequestOutput]:
        """Run requests 0 .. len(samples) - 1, request i of samples[i] sequences, built by `build(first,
        stop)` as the engine asks for them (core/request_feed.py); one RequestOutput per request, its
        samples in index order."""
        done: list[list[RequestOutput]] = [[] for _ in samples]
        bar = None
        if use_tqdm and samples:
            from tqdm.auto import tqdm

            bar = tqdm(total=sum(samples), desc="generate", unit="seq", dynamic_ncols=True)
        t0 = time.perf_counter()
        out_tokens = 0

        # A request's index by its sequences' ids, filled as the feed builds them.
        index: dict[int, int] = {}

        def build_indexed(first: int, stop: int) -> list[list[Sequence]]:
            groups = build(first, stop)
            index.update((s.seq_id, i) for i, g in zip(range(first, stop), groups) for s in g)
            return groups

        def on_finish(seq: Sequence) -> None:
            nonlocal out_tokens
            i = index[seq.seq_id]
            done[i].append(self.engine.outputs.build_output(seq, texts[i]))
            out_tokens += seq.num_output_tokens
            if bar is not None:
                bar.update(1)
                bar.set_postfix(out_tok_s=f"{out_tokens / max(time.perf_counter() - t0, 1e-9):.0f}")

        try:
            # The A/B switch builds every request before the first step (one chunk), as before the feed.
            chunk = max(1, len(samples)) if env_flag(QUEUE_ALL_ENV) else FEED_CHUNK
            self.engine.run(on_finish, RequestFeed(build_indexed, len(samples), chunk))
        except BaseException:
            self.engine.abort_all()  # leave the engine empty and usable for the next call
            raise
        finally:
            if bar is not None:
                bar.close()
        return [_merge_samples(outs) for outs in done]


def _merge_samples(outs: list[RequestOutput]) -> RequestOutput:
    """One request's output from its samples' (each holds one completion): sample 0 gives the prompt
    fields, the request id and the metrics; `outputs` lists the completions by sample index."""
    outs = sorted(outs, key=lambda o: o.outputs[0].index)
    first = outs[0]
    first.outputs = [o.outputs[0] for o in outs]
    return first
