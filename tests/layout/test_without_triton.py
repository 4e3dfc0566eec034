"""With Triton absent, the CPU engine still generates, with and without a JSON schema (quick-start path)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import importlib.abc, json, sys

    class BlockTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, BlockTriton())
    from deepinfer.engine import LLM, SamplingParams

    llm = LLM(model=sys.argv[1], device="cpu", cpu_kv_cache_gib=0.05)
    schema = {"type": "object", "properties": {"label": {"enum": ["good", "bad"]}}, "required": ["label"],
              "additionalProperties": False}
    free, constrained = llm.generate(
        ["Review: fine.", "Review: awful."],
        [SamplingParams(max_tokens=8, temperature=0.0),
         SamplingParams(max_tokens=40, temperature=1.0, seed=3, json_schema=schema)],
        use_tqdm=False,
    )
    print(json.dumps({"free": free.token_ids, "text": constrained.text, "finish": constrained.finish_reason,
                      "triton_loaded": any(m == "triton" or m.startswith("triton.") for m in sys.modules)}))
''')


def test_cpu_engine_generates_with_and_without_a_schema_when_triton_is_blocked(tiny_checkpoint):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_checkpoint("llama"))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["triton_loaded"] is False
    assert len(result["free"]) == 8
    assert result["finish"] == "stop" and json.loads(result["text"])["label"] in ("good", "bad")
