"""The one-row GEMV (``gemv``): compiled for Hopper without a GPU (its dependents triggered first, its first stages
of weights copied before its PDL wait, no stack frame); on the GPU against float64, and ``linear``'s choice of it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.models.kernels.conftest import rel_err

ROOT = Path(__file__).resolve().parents[3]
QWEN3_0_6B = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]     # qkv, o_proj, gate_up, down


def test_the_gemv_triggers_its_dependents_then_copies_its_first_stages_before_its_wait():
    from blink.models.kernels import gemv

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("gemv_ptx.py")),
                          *(f"{n},{k}" for n, k in QWEN3_0_6B)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for row in json.loads(run.stdout):
        block_n = gemv.block_n_for(row["n"])
        copies_a_stage = block_n * gemv.BLOCK_K // (32 * gemv.NUM_WARPS * 8)    # 16-byte copies a thread issues
        first_stages = min(row["k"] // gemv.BLOCK_K, gemv.STAGES)
        order = row["order"]
        assert order[0] == "griddepcontrol.launch_dependents", row
        assert order[1:].index("griddepcontrol.wait") == first_stages * copies_a_stage, row
        assert row["shared_bytes"] == gemv.STAGES * block_n * gemv.BLOCK_K * 2 and row["local_bytes"] == 0, row


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [*QWEN3_0_6B, (3072, 2048), (96, 512)])
def test_gemv_matches_float64_and_linear_takes_it_for_one_row_of_a_small_projection(n, k):
    from blink.models.kernels.gemv import gemv
    from blink.models.kernels.linear import linear

    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out = gemv(x, weight)
    assert out.shape == (1, n) and rel_err(out, x.double() @ weight.double().T) < 1e-2
    assert torch.equal(linear(x, weight), out)


@pytest.mark.gpu
def test_linear_keeps_the_skinny_gemm_for_large_weights_more_rows_and_without_pdl(monkeypatch):
    from blink.models.kernels.gemv import MAX_WEIGHT_BYTES, gemv, gemv_takes
    from blink.models.kernels.linear import linear
    from blink.models.kernels.skinny import skinny_linear

    k = 1024
    large = torch.randn(MAX_WEIGHT_BYTES // (2 * k) + 16, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    small = large[:1024]
    one, two = (torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for rows in (1, 2))
    assert gemv_takes(one, small) and not gemv_takes(one, large) and not gemv_takes(two, small)
    assert not gemv_takes(one[:, :256], small[:, :256].contiguous())      # K of one stage: below MIN_K
    assert torch.equal(linear(one, large), skinny_linear(one, large))
    assert torch.equal(linear(two, small), skinny_linear(two, small))
    with pytest.raises(ValueError, match="one contiguous bf16 row"):
        gemv(two, small)
    monkeypatch.setenv("BLINK_PDL", "0")
    assert not gemv_takes(one, small)
