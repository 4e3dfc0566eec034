"""When kernels/pdl.py turns programmatic dependent launch on: only for CUDA devices of sm_90+, never under
the CPU interpreter or with $DEEPINFER_DISABLE_PDL set; on, the kernel's wait and the early launch come
together (a kernel must never be launched early without its wait)."""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.pdl import DISABLE_ENV, pdl_options

CASES = [  # (device, environment, expected)
    ("cpu", {}, {}),
    ("cpu", {DISABLE_ENV: "0"}, {}),
    ("cuda", {DISABLE_ENV: "1"}, {}),
    ("cuda:1", {DISABLE_ENV: "yes"}, {}),
    ("cuda", {"TRITON_INTERPRET": "1"}, {}),
]


@pytest.mark.parametrize("device,env,expected", CASES)
def test_off_where_it_cannot_or_must_not_run(device, env, expected, monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert pdl_options(torch.device(device)) == expected


@pytest.mark.gpu
def test_on_for_hopper_with_wait_and_launch_together(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    opts = pdl_options(torch.device("cuda"))
    if torch.cuda.get_device_capability()[0] < 9:
        assert opts == {}
    else:
        assert opts == {"PDL": 1, "launch_pdl": True}
