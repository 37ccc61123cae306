"""Kernels that decide memory and speed: FP8 block-quantized base weights, fused token log-probs,
decode GEMMs. Kernels know no model loading (FP8-Block checkpoints: `grpo/model/fp8_checkpoint.py`).

Importing this package imports torch only; Triton is imported inside the functions that need it.
"""

from grpo.kernels.fp8 import (
    FP8Linear,
    dequantize_fp8_block,
    fp8_linear,
    quantize_fp8_block,
    quantize_linears_,
)
from grpo.kernels.logprobs import token_logprobs, token_logprobs_ref

__all__ = [
    "FP8Linear",
    "dequantize_fp8_block",
    "fp8_linear",
    "quantize_fp8_block",
    "quantize_linears_",
    "token_logprobs",
    "token_logprobs_ref",
]
