"""sampling.n, sampling.logprobs and sampling.prompt_logprobs in a job: one row per sample with its
sample_index and its own seed (sample_seed(row seed, i)), distinct samples, the documented Arrow layout
of logprobs checked against HF transformers' log-softmax, identical bytes after an interrupted run is
resumed, and `verify` recomputing sample rows byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import torch
from deepinfer.engine.sample.rng import derive_seed, sample_seed
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.output.commit import OutputStore

from tests.support.pipeline_helpers import output_digest, read_parts, write_jsonl, write_spec

transformers = pytest.importorskip("transformers")

N, K, PK, SEED = 4, 2, 1, 5
ROWS = [{"rid": f"r{i}", "text": f"hello number {i}"} for i in range(4)]
TOP = pa.struct([("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float64()),
                 ("rank", pa.int64())])
LAYOUT = pa.list_(pa.struct([*TOP, ("top", pa.list_(TOP))]))


def _spec(tmp_path: Path, model_dir: str, data: Path, out: Path) -> str:
    return write_spec(tmp_path / f"{out.name}.yaml", {
        "model": {"path": model_dir, "device": "cpu"},  # compared with HF float32 on CPU
        "input": {"path": str(data), "format": "jsonl", "id_column": "rid"},
        "prompt": {"mode": "raw", "template": "Say: {{ text }}"},
        "sampling": {"temperature": 1.0, "max_tokens": 3, "seed": SEED, "n": N, "logprobs": K,
                     "prompt_logprobs": PK, "ignore_eos": True},
        "output": {"path": str(out), "format": "parquet"},
        "runtime": {"executor": "local", "rows_per_part": 2, "batch_size": 3},
    })


class _CrashAfterFirstCommit:
    def reached(self, point: str) -> None:
        if point == "after_part_committed":
            raise RuntimeError("simulated crash after the first commit")


def _check_logprobs_against_hf(model_dir: str, row: dict) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = tok(f"Say: {ROWS[int(row['rid'][1:])]['text']}").input_ids
    assert [e["token_id"] for e in row["prompt_logprobs"][1:]] == prompt_ids[1:]
    assert row["prompt_logprobs"][0] is None  # nothing predicts the first prompt token
    out_ids = [e["token_id"] for e in row["logprobs"]]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt_ids + out_ids])).logits[0].float(), dim=-1)
    entries = row["prompt_logprobs"][1:] + row["logprobs"]
    for pos, entry in enumerate(entries, start=1):
        want = logp[pos - 1]
        assert entry["logprob"] == pytest.approx(float(want[entry["token_id"]]), abs=1e-4)
        ranked = torch.argsort(want, descending=True, stable=True).tolist()
        assert [t["token_id"] for t in entry["top"]][:1] == ranked[:1]
        assert [t["rank"] for t in entry["top"]] == list(range(1, len(entry["top"]) + 1))
        for t in entry["top"]:
            assert t["logprob"] == pytest.approx(float(want[t["token_id"]]), abs=1e-4)


def test_n_samples_logprobs_layout_determinism_and_resume(model_dir: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "in" / "rows.jsonl"
    write_jsonl(data, ROWS)
    full = tmp_path / "full"
    assert main(["submit", _spec(tmp_path, model_dir, data, full)]) == 0
    table = read_parts(full)
    assert table.schema.field("logprobs").type == LAYOUT
    assert table.schema.field("prompt_logprobs").type == LAYOUT
    assert table.schema.field("sample_index").type == pa.int64()
    rows = table.to_pylist()
    assert len(rows) == N * len(ROWS)
    for src in ROWS:
        mine = [r for r in rows if r["rid"] == src["rid"]]
        assert [r["sample_index"] for r in mine] == list(range(N))
        row_seed = derive_seed(SEED, src["rid"])
        assert [r["seed"] for r in mine] == [sample_seed(row_seed, i) for i in range(N)]
        assert len({r["seed"] for r in mine}) == N
        assert len({tuple(e["token_id"] for e in r["logprobs"]) for r in mine}) > 1  # distinct samples
        assert all(r["prompt_logprobs"] == mine[0]["prompt_logprobs"] for r in mine)
        for r in mine:
            assert len(r["logprobs"]) == r["output_tokens"] == 3
            assert len(r["prompt_logprobs"]) == r["prompt_tokens"]
            assert all(len(e["top"]) == K for e in r["logprobs"])
            assert all(len(e["top"]) == PK for e in r["prompt_logprobs"][1:])
    _check_logprobs_against_hf(model_dir, rows[1])

    # interrupted after its first part's commit, then resumed: the same bytes as the uninterrupted run
    resumed = tmp_path / "resumed"
    spec = _spec(tmp_path, model_dir, data, resumed)
    monkeypatch.setattr(OutputStore, "default_hooks", _CrashAfterFirstCommit())
    assert main(["submit", spec]) != 0
    assert len(list((resumed / "_commits").glob("*.json"))) == 1
    monkeypatch.setattr(OutputStore, "default_hooks", None)
    assert main(["submit", spec]) == 0
    assert output_digest(resumed) == output_digest(full)
    assert main(["verify", str(full), "--sample", "6"]) == 0
