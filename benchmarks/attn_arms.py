"""The arms benchmarks/attn_variants.py times: pairs of tile configs for kernels/paged_attention_kernel.py,
one for decode steps and one for prefill/recompute chunks, by cache dtype and name."""

from __future__ import annotations


def _cfg(m: int, n: int = 64, warps: int = 4, stages: int = 3, swap: int = 0, f16: int = 0,
         vnat: int = 0, vcvt: int = 0, pf: int = 0, ds: int = 0) -> dict:
    """A config with BLOCK_M rows; BLOCK_Q is filled in per shape by `_fit`."""
    return {"BLOCK_M": m, "BLOCK_Q": 0, "BLOCK_N": n, "num_warps": warps, "num_stages": stages,
            "SWAP": swap, "FP16_KV": f16, "V_NAT": vnat, "V_CVT": vcvt, "PREFETCH": pf, "DOT_SUM": ds}


def _pair(n: int = 64, warps: int = 4, stages: int = 3, pre_m: int = 64, **kw) -> tuple[dict, dict]:
    """(16-row transposed decode config, `pre_m`-row transposed prefill config) sharing the KV tiles."""
    return (_cfg(16, n, warps, stages, swap=1, **kw), _cfg(pre_m, n, warps, stages, swap=1, **kw))


def _plain(n: int = 64, warps: int = 4, stages: int = 2, pre_m: int = 32, dec_stages: int | None = None,
           **kw) -> tuple[dict, dict]:
    """(16-row untransposed decode config, `pre_m`-row untransposed prefill config). Below 64 rows the
    untransposed tile compiles to mma.sync for both (wgmma needs M % 64 == 0), and with BLOCK_M < BLOCK_N
    Triton lays the warps out along the keys for both, so a row's arithmetic is the same in either. The
    stages (data movement only) may differ: `dec_stages` for decode, else `stages`."""
    return (_cfg(16, n, warps, stages if dec_stages is None else dec_stages, **kw),
            _cfg(pre_m, n, warps, stages, **kw))


def _dsum(n: int, dec_warps: int, pre_warps: int = 4, stages: int = 3, pre_stages: int | None = None,
          pre_m: int = 32, **kw) -> tuple[dict, dict]:
    """(16-row decode config of `dec_warps` warps, `pre_m`-row prefill config of `pre_warps` warps), both
    untransposed with the row sums through the tensor core (DOT_SUM): no row reduction follows the warps'
    layout, so decode and prefill may differ in warps."""
    return (_cfg(16, n, dec_warps, stages, ds=1, **kw),
            _cfg(pre_m, n, pre_warps, stages if pre_stages is None else pre_stages, ds=1, **kw))


# cache -> name -> (decode config, prefill config). "cur" (None here) is the shipped config of each shape
# (kernels/paged_attention.py, attention_tile_config), listed first: eq_cur compares the other arms' decode
# rows with its. vnat: value tiles loaded in memory order and transposed in registers (V_NAT); mma2: the
# untransposed mma.sync tiles (16 decode / 32 prefill rows; the shipped family); cvt: the e4m3 value tile
# converted before it becomes an operand (V_CVT); swap: the transposed wgmma tiles shipped before.
# pf: the block ids a tile ahead (PREFETCH). ds: row sums through the tensor core (DOT_SUM), decode and
# prefill warps chosen apart (`_dsum`). benchmarks/RESULTS.md has the arms that lost (2026-12-02 05:10:
# e4m3 bit conversion, split-KV, 8 warps, 256-key tiles; 16:58 UTC: each key tile's products as two halves
# of MMAs; 20:00 UTC: per-warp softmax states, the key tile converted before the MMA, 32-key tiles).
ARMS = {   # in order of interest: the budget guard drops the tail
    "bf16": {
        "cur": None,
        "ds_w4n64": _dsum(64, 4, stages=2),
        "ds_w1n32": _dsum(32, 1, stages=2),
        "ds_w1n32s3": _dsum(32, 1, stages=3, pre_stages=2),
        "ds_w2n32": _dsum(32, 2, stages=2),
        "ds_w2n64": _dsum(64, 2, stages=2),
        "ds_w1n16": _dsum(16, 1, 2, stages=2),
        "ds_w4n64_p2m64": _dsum(64, 4, 2, stages=2, pre_m=64),
        "ds_w1n32s3_p2m64": _dsum(32, 1, 2, stages=3, pre_stages=2, pre_m=64),
        "pf_n64s3": _plain(64, stages=3, pf=1),
        "pf_n64s4": _plain(64, stages=4, pf=1),
        "pf_n128s3": _plain(128, stages=3, pf=1),
        "pf_n64s2": _plain(64, stages=2, pf=1),
        "swap_vnat": _pair(64, stages=2, vnat=1),
        "no_vnat": _pair(64, stages=2),
        "vnat_s3": _pair(64, stages=3, vnat=1),
        "n32s3vnat": _pair(32, stages=3, vnat=1),
        "mma2_n64s2": _plain(64),
        "mma2_n128s2": _plain(128),
        "mma2_n64s3": _plain(64, stages=3),
        "mma2_n128s2_p16": _plain(128, pre_m=16),
        # one stage for decode: half the shared memory of the shipped tile, so the 512 programs of a
        # 256-row 0.5B step (2 kv heads) fit the SMs in one wave instead of ~1.3
        "mma2_n128_d1": _plain(128, dec_stages=1),
        "mma2_n64_d1": _plain(64, dec_stages=1),
        "mma2_n128_w2_d1": _plain(128, warps=2, dec_stages=1),
        "mma2_n128_w2": _plain(128, warps=2),
        "mma2_n64_w2_d1": _plain(64, warps=2, dec_stages=1),
    },
    "e4m3": {
        "cur": None,
        "ds_w4n64": _dsum(64, 4, f16=1, vcvt=1, pf=1),
        "ds_w1n32": _dsum(32, 1, f16=1, vcvt=1, pf=1),
        "ds_w1n32s2": _dsum(32, 1, stages=2, pre_stages=3, f16=1, vcvt=1, pf=1),
        "ds_w1n32s4": _dsum(32, 1, stages=4, pre_stages=3, f16=1, vcvt=1, pf=1),
        "ds_w2n32": _dsum(32, 2, f16=1, vcvt=1, pf=1),
        "ds_w2n64": _dsum(64, 2, f16=1, vcvt=1, pf=1),
        "ds_w1n16": _dsum(16, 1, 2, f16=1, vcvt=1, pf=1),
        "ds_w1n16s4": _dsum(16, 1, 2, stages=4, pre_stages=3, f16=1, vcvt=1, pf=1),
        "ds_w1n32_p2": _dsum(32, 1, 2, f16=1, vcvt=1, pf=1),
        "ds_w1n16s5": _dsum(16, 1, 2, stages=5, pre_stages=3, f16=1, vcvt=1, pf=1),
        "ds_w1n16s6": _dsum(16, 1, 2, stages=6, pre_stages=3, f16=1, vcvt=1, pf=1),
        "ds_w1n16s4_p2s4": _dsum(16, 1, 2, stages=4, f16=1, vcvt=1, pf=1),
        "ds_w1n32s4_p2": _dsum(32, 1, 2, stages=4, pre_stages=3, f16=1, vcvt=1, pf=1),
        "ds_w1n16s4_nopf": _dsum(16, 1, 2, stages=4, pre_stages=3, f16=1, vcvt=1),
        # prefill tiles of 64 rows (two warps: still mma.sync), 16 tokens sharing each key/value tile
        "ds_w1n16s4_p2m64": _dsum(16, 1, 2, stages=4, pre_stages=3, pre_m=64, f16=1, vcvt=1, pf=1),
        "ds_w1n16s4_p2m64s2": _dsum(16, 1, 2, stages=4, pre_stages=2, pre_m=64, f16=1, vcvt=1, pf=1),
        "ds_w1n16s4_p1m32": _dsum(16, 1, 1, stages=4, pre_stages=3, f16=1, vcvt=1, pf=1),
        "ds_w1n32_p2m64": _dsum(32, 1, 2, pre_m=64, f16=1, vcvt=1, pf=1),
        "pf_n64s3": _plain(64, stages=3, f16=1, vcvt=1, pf=1),
        "pf_n64s4": _plain(64, stages=4, f16=1, vcvt=1, pf=1),
        "pf_n64s5": _plain(64, stages=5, f16=1, vcvt=1, pf=1),
        "pf_n128s3": _plain(128, stages=3, f16=1, vcvt=1, pf=1),
        "pf_n64s2": _plain(64, stages=2, f16=1, vcvt=1, pf=1),
        "pf_n64s3_w8": _plain(64, warps=8, stages=3, f16=1, vcvt=1, pf=1),
        "pf_n32s3": _plain(32, stages=3, f16=1, vcvt=1, pf=1),
        "pf_n32s4": _plain(32, stages=4, f16=1, vcvt=1, pf=1),
        "swap_f16": _pair(128, f16=1),
        "swap_f16_p32": _pair(128, f16=1, pre_m=32),
        "cvt_mma2_n128s2": _plain(128, f16=1, vcvt=1),
        "cvt_mma2_n64s2": _plain(64, f16=1, vcvt=1),
        "cvt_mma2_n128s3": _plain(128, stages=3, f16=1, vcvt=1),
        "cvt_mma2_n64s3": _plain(64, stages=3, f16=1, vcvt=1),
        "cvt_vnat_n128s3": _pair(128, f16=1, vnat=1, vcvt=1),
        "cvt_vnat_n128s2": _pair(128, stages=2, f16=1, vnat=1, vcvt=1),
        "vnat": _pair(128, f16=1, vnat=1),
        "s2": _pair(128, stages=2, f16=1),
        "s4": _pair(128, stages=4, f16=1),
        "w8": _pair(128, warps=8, f16=1),
        "n256s2": _pair(256, stages=2, f16=1),
        "mma2_n64s2": _plain(64, f16=1),
        "mma2_n128s2": _plain(128, f16=1),
        "mma2_n64s3": _plain(64, stages=3, f16=1),
        "mma2_n128s3": _plain(128, stages=3, f16=1),
        "mma2_n128s2_w8": _plain(128, warps=8, f16=1),
        "mma2_n128s2_p16": _plain(128, pre_m=16, f16=1),
    },
}
