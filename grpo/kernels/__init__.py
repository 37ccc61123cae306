"""Kernels that decide memory and speed: FP8 block-quantized base weights, fused token log-probs.

Importing this package imports torch only; Triton, accelerate, safetensors and transformers are
imported inside the functions that need them.
"""

from grpo.kernels.fp8 import (
    FP8Linear,
    dequantize_fp8_block,
    fp8_linear,
    is_fp8_block_checkpoint,
    load_fp8_block_model,
    quantize_fp8_block,
    quantize_linears_,
)
from grpo.kernels.logprobs import token_logprobs, token_logprobs_ref

__all__ = [
    "FP8Linear",
    "dequantize_fp8_block",
    "fp8_linear",
    "is_fp8_block_checkpoint",
    "load_fp8_block_model",
    "quantize_fp8_block",
    "quantize_linears_",
    "token_logprobs",
    "token_logprobs_ref",
]
