"""Every Triton kernel of the step compiles for Hopper (sm_90) at the step's real widths, with no stack frame (no
spills), and the FP8 skinny GEMM widens its e4m3 weights without conversion instructions (``kernels.widen``):
``bench/kernel_resources.py``, in a process of its own (the kernels compiled, not interpreted), on a machine with or
without a GPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# The kernels each model's steps launch (a decode of 1 and of 64 sequences, a 64-token prefill), bf16 and FP8 weights.
EXPECTED = {
    "qwen3-8b": {"_skinny_kernel", "_rowwise_kernel", "_quantize_kernel", "_rms_norm_kernel",
                 "_silu_and_mul_e4m3_kernel", "_rope_kv_write_kernel", "_attention_kernel", "_gumbel_argmax_kernel",
                 "_logit_bias_kernel", "_store_sampled_kernel", "_sampling_params_kernel", "_pick_chunk_kernel",
                 "_histogram_kernel", "_pick_kernel", "_gather_kernel", "_sort_kernel"},
    "qwen3-30b-a3b": {"_moe_route_kernel", "_moe_align_kernel", "_moe_gemm_kernel", "_moe_sum_top_k_kernel"},
}


def test_the_steps_kernels_compile_for_hopper_without_spills_at_bf16_and_fp8(tmp_path):
    out = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-m", "bench.kernel_resources", "--models", *EXPECTED,
                          "--layouts", "bf16", "fp8", "--batches", "1", "64", "--prefill", "64", "--json", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    for model, kernels in EXPECTED.items():
        compiled = {r["kernel"] for r in rows if r["model"] == model}
        assert kernels <= compiled, f"{model}: {sorted(kernels - compiled)} not compiled"
    assert all(0 < r["registers"] <= 255 and r["stack_bytes"] == 0 for r in rows)
    # Triton's own widening is F2FP.F16.E4M3 then F2F.BF16.F16 per value; widen's leaves only the epilogue's packing.
    skinny = [r for r in rows if r["kernel"] == "_skinny_kernel"]
    assert skinny and all(not op.startswith(("F2F.BF16.F16", "F2FP.F16.E4M3")) for r in skinny
                          for op in r["conversions"]), [r["conversions"] for r in skinny]
