"""Expert parallel MoE (engine/parallel/expert_parallel.py) on 2 gloo ranks against the single-device layer,
and the group's collectives (engine/parallel/comm.py) it and tensor parallelism run on.

Each rank brings its own tokens (uneven counts, and a rank with none); the experts are split 4 + 4. In
deterministic mode every token's output must be bitwise the single-process DeepseekMoE's.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from deepinfer.engine.layers.backends import make_ops
from deepinfer.engine.layers.moe import DeepseekMoE
from deepinfer.engine.models.deepseek_config import MoEConfig

HIDDEN = 32
# V3-style routing (sigmoid, grouped, scaled); 8 experts so each of 2 ranks holds 4.
MOE = MoEConfig(n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, moe_intermediate_size=16,
                topk_method="noaux_tc", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                norm_topk_prob=True, first_k_dense_replace=0)
SPLITS = ((7, 4), (11, 0), (1, 10))   # tokens on rank 0, rank 1 per call


def _moe(deterministic: bool) -> DeepseekMoE:
    layer = DeepseekMoE(MOE, HIDDEN, False, make_ops(torch.device("cpu"), deterministic), torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def _tokens(n: int, call: int) -> torch.Tensor:
    return torch.randn((n, HIDDEN), generator=torch.Generator().manual_seed(100 + call))


def _collectives(group, fast, rank: int) -> dict:
    """The group's collectives on rank-dependent inputs (checked by the parent)."""
    x = torch.randn((5, 3), generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    chunks = [torch.full((rank + 1 + s, 2), float(10 * rank + s)) for s in range(2)]   # uneven rows
    return {"ordered": group.reduce_sum(x), "native": fast.reduce_sum(x),
            "a2a": group.all_to_all(chunks), "bcast": group.broadcast(torch.full((2,), float(rank)), 1)}


def _rank_main(rank: int, store_path: str, out_dir: str) -> None:
    from deepinfer.engine.parallel.comm import ParallelGroup
    from deepinfer.engine.parallel.expert_parallel import ExpertParallelMoE

    torch.set_num_threads(1)
    group = ParallelGroup(dist.FileStore(store_path, 2), rank, 2, torch.device("cpu"), deterministic=True)
    fast = ParallelGroup(dist.FileStore(store_path + ".fast", 2), rank, 2, torch.device("cpu"),
                         deterministic=False)
    outs = {"collectives": _collectives(group, fast, rank)}
    with torch.inference_mode():
        for deterministic in (True, False):
            ep = ExpertParallelMoE.from_layer(_moe(deterministic), group)
            assert ep.gate_up_proj.shape[0] == 4 and ep.first_expert == 4 * rank
            for call, split in enumerate(SPLITS):
                x = _tokens(sum(split), call)
                lo = sum(split[:rank])
                outs[deterministic, call] = ep(x[lo:lo + split[rank]])
    torch.save(outs, Path(out_dir) / f"rank{rank}.pt")


def test_expert_parallel_matches_single_device_moe(tmp_path) -> None:
    # fork: the ranks start at once with this process's imports (CPU only, no CUDA state to inherit).
    mp.start_processes(_rank_main, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    xs = [torch.randn((5, 3), generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
          for r in range(2)]
    for r, got in enumerate(ranks):
        c = got["collectives"]
        # Deterministic: float32 sum in rank order, rounded once; native: the backend's bf16 all-reduce.
        assert torch.equal(c["ordered"], (xs[0].float() + xs[1].float()).to(torch.bfloat16))
        torch.testing.assert_close(c["native"], c["ordered"], rtol=1e-2, atol=1e-2)
        assert [t.shape[0] for t in c["a2a"]] == [1 + r, 2 + r]    # rank s sent me s + 1 + r rows
        assert [t.unique().item() for t in c["a2a"]] == [float(r), float(10 + r)]
        assert c["bcast"].tolist() == [1.0, 1.0]
    with torch.inference_mode():
        for deterministic in (True, False):
            ref = _moe(deterministic)
            for call, split in enumerate(SPLITS):
                expected = ref(_tokens(sum(split), call))
                got = torch.cat([ranks[0][deterministic, call], ranks[1][deterministic, call]])
                assert got.shape == expected.shape
                if deterministic:   # bitwise: a token's result does not depend on where its experts ran
                    assert torch.equal(got, expected), f"call {call}: EP differs from the single-device layer"
                else:
                    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
