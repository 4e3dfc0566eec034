"""CUDA graphs on vs off on ONE engine: the same weights, KV cache and prompts, the two arms interleaved.

`graphs_ab` swaps the engine's decode graphs (`StepExecutor.graphs`) in and out between runs: the "eager"
arm runs every decode step eagerly, the "graphs" arm replays the captured buckets. Graphs are captured
lazily (only the buckets the workload uses), inside the graphs arm's warm-up. Each arm gets one warm-up,
then `runs` rounds alternate which arm goes first (eager-graphs, graphs-eager, ...), so drift of a shared
GPU falls on both arms alike. Every measured run's tokens are compared with the first measured run's: in
deterministic mode graphs change no bit, so a difference is a bug and is reported (`tokens_identical`).

On CPU (`--quick` smoke runs) the engine has no graphs; eager stand-in replays (cuda_graphs.DecodeGraphs
with `capture_lazily(stand_ins=True)`) take their place, so the script runs end to end; its timings mean
nothing there.
"""

from __future__ import annotations

from typing import Any

from common import JsonOut, StepRecorder, spread, timed_generate


def _graphs_of(llm: Any) -> Any:
    """The engine's DecodeGraphs; stand-ins on CPU; RuntimeError where a CUDA engine has none."""
    ex = llm.engine.executor
    if ex.graphs is not None:
        return ex.graphs
    if llm.device.type != "cpu":
        raise RuntimeError("graphs A/B: this engine has no CUDA graphs (enable_cuda_graphs=False, "
                           "DEEPINFER_DISABLE_CUDA_GRAPHS=1, or a model graphs do not support)")
    from deepinfer.engine.runner.cuda_graphs import DecodeGraphs

    r = llm.engine.runner
    graphs = DecodeGraphs(r.model, r.kv_caches, r.block_size, llm.sched_cfg.max_model_len,
                          llm.sched_cfg.max_num_seqs, llm.device)
    graphs.capture_lazily(stand_ins=True)
    return graphs


def graphs_ab(llm: Any, prompts: list, sp: Any, runs: int, out: JsonOut, label: str) -> dict[str, Any]:
    """Interleaved eager / graphs runs of `prompts` on `llm` (module docstring); per arm the seconds and
    decode-step host ms of each run (median, min, max), and the graphs' buckets and capture cost."""
    ex = llm.engine.executor
    graphs = _graphs_of(llm)
    arms = {"eager": None, "graphs": graphs}
    rec = StepRecorder(llm)

    def run(arm: str) -> tuple[float, list[list[int]], float | None]:
        ex.graphs = arms[arm]
        rec.reset()
        dt, outs = timed_generate(llm, prompts, sp, rec)
        decode = rec.host_summary().get("decode")
        return dt, [o.token_ids for o in outs], decode["host_ms_per_step"]["median"] if decode else None

    try:
        for arm in arms:
            run(arm)   # warm-up: compiles; the graphs arm captures the buckets it needs
        seconds: dict[str, list[float]] = {a: [] for a in arms}
        step_ms: dict[str, list[float]] = {a: [] for a in arms}
        first, identical = None, True
        for i in range(runs):
            for arm in (("eager", "graphs") if i % 2 == 0 else ("graphs", "eager")):
                dt, toks, ms = run(arm)
                first = first if first is not None else toks
                same = toks == first
                identical &= same
                seconds[arm].append(dt)
                if ms is not None:
                    step_ms[arm].append(ms)
                out.line({"arm": f"{label}/{arm}", "run": i, "seconds": dt,
                          "output_tokens": sum(map(len, toks)), "decode_step_host_ms_median": ms,
                          "same_tokens_as_first_run": same})
    finally:
        ex.graphs = graphs if llm.device.type != "cpu" else None   # the engine as it was built
    result: dict[str, Any] = {"tokens_identical": identical, "output_tokens": sum(map(len, first or []))}
    for arm in arms:
        result[arm] = {"seconds": spread(seconds[arm]),
                       "decode_step_host_ms": spread(step_ms[arm]) if step_ms[arm] else None}
    result["speedup_median"] = result["eager"]["seconds"]["median"] / result["graphs"]["seconds"]["median"]
    st = graphs.stats
    result["graphs"].update(buckets=list(st.buckets), capture_seconds=st.capture_seconds,
                            memory_bytes=st.memory_bytes, replays=st.replays, padded_rows=st.padded_rows)
    return result
