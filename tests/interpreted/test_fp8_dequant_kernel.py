"""FP8 dequantization's Triton kernel (grpo/kernels/fp8.py), run by Triton's interpreter on the CPU.

Collected only when TRITON_INTERPRET=1 (tests/test_decode_gemm.py runs this folder in a subprocess). The
kernel's float32 product is the reference's bit for bit; rounding it to bf16 the interpreter truncates where the
GPU rounds to nearest even (the CUDA test holds bf16 to every bit), so bf16 is held to one step of its precision.
"""

from __future__ import annotations

import pytest
import torch

from grpo.kernels.fp8 import dequantize_fp8_block, quantize_fp8_block


@pytest.mark.parametrize("n,k", [(256, 384), (200, 130), (1, 5)])  # 200 x 130 and 1 x 5: partial edge blocks
def test_the_kernel_dequantizes_as_the_reference_does(n, k):
    torch.manual_seed(n + k)
    codes, scale = quantize_fp8_block(torch.randn(n, k) * 3)
    for dtype, bits in ((torch.float32, torch.int32), (torch.float16, torch.int16)):
        kernel = dequantize_fp8_block(codes, scale, dtype, impl="triton")
        assert torch.equal(kernel.view(bits), dequantize_fp8_block(codes, scale, dtype, impl="ref").view(bits))
    exact = dequantize_fp8_block(codes, scale, torch.float32, impl="ref")
    bf16 = dequantize_fp8_block(codes, scale, torch.bfloat16, impl="triton").float()
    assert ((bf16 - exact).abs() <= exact.abs() * 2**-7).all()  # within bf16's 8 bits of precision
