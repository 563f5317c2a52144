"""e4m3 tiles widened to bf16 in registers by moving bits, not by Hopper's conversion instructions.

Triton widens e4m3 to bf16 in two conversions: pairs of e4m3 to pairs of f16 (SASS ``F2FP``), then each f16 to
bf16 (``F2F``, 16 values a clock per SM on sm_90). An FP8 decode GEMM widens every weight byte it reads: 48 of
the skinny GEMM's 169 loop instructions were these conversions, the F2Fs at a quarter of the full rate, and it took
the same microseconds on an H100 and an H200 (``bench/results/fp8_gemv_bench_*``) though the H200's HBM is 1.4x
faster: a limit of the SMs, not of HBM.

e4m3 is a sign, 4 exponent bits (bias 7) and 3 mantissa bits; bf16 a sign, 8 exponent bits (bias 127) and 7 mantissa
bits. e4m3's sign moved to bf16's and its other 7 bits to the low end of bf16's exponent and the top of its mantissa
give a bf16 of the e4m3's value times 2^-120 (subnormals land on bf16's subnormals, so also exactly), and one
multiplication by 2^120 makes it the value. For four values that is two byte permutes and, per pair, two masks, a
shift, an or and a bf16x2 fused multiply-add: integer and FMA instructions at full rate. The Qwen3-8B FP8 step at
B = 1 took 10 % less on the H200 (3.93 against 4.38 ms), 3.5 % less on an H100 (docs/models.md, "FP8 weights").

The asm is pure, though Triton then moves the MMA operand's layout change ahead of it and attention's V reaches the
operand byte by byte (64 ``LDS.U8`` a loop body): declared impure, it widened in the load's layout in fewer
instructions but ran slower on an H100 (``53327b0``: the Qwen3-8B FP8 step at B = 1 5.37 ms against 4.45).

e4m3's NaN codes (0x7F, 0xFF) become ±480; the quantizers never write them (they clamp to ±448). Triton's
interpreter has no inline PTX, so where the kernels are interpreted (``TRITON_INTERPRET`` when they are decorated)
the tile is converted by Triton as before: the same values.
"""
from __future__ import annotations

import triton
import triton.language as tl

PTX = tl.constexpr(not triton.knobs.runtime.interpret)

# $2 holds four e4m3 bytes, $0 and $1 two bf16 each (values 0-1 and 2-3). For each pair prmt puts its two bytes in
# the high bytes of the two halves (0x1404: bytes 0 and 1; 0x3424: bytes 2 and 3), leaving each half's sign at bf16's
# place; the 7 bits below it move down 4 places; fma by 2^120 (bf16 0x7B80) plus -0 rebiases the exponent, exact.
_PAIR = """prmt.b32 t, $2, 0, {select};
and.b32 e, t, 0x7F007F00;
shr.b32 e, e, 4;
and.b32 t, t, 0x80008000;
or.b32 t, t, e;
fma.rn.bf16x2 {out}, t, k, z;
"""
E4M3_TO_BF16 = tl.constexpr("{\n.reg .b32 t, e, k, z;\nmov.b32 k, 0x7B807B80;\nmov.b32 z, 0x80008000;\n"
                            + _PAIR.format(select="0x1404", out="$0") + _PAIR.format(select="0x3424", out="$1") + "}")


@triton.jit
def widen(x, dtype: tl.constexpr):
    """``x.to(dtype)``, exact for an e4m3 ``x``; e4m3 to bf16 by moving bits (compiled), any other by Triton."""
    if PTX and x.dtype == tl.float8e4nv and dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(E4M3_TO_BF16, "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16,
                                         is_pure=True, pack=4)
    else:
        return x.to(dtype)
