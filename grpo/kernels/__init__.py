"""The kernels that decide memory and speed, each beside the plain-PyTorch reference its tests compare with.

- `fp8`: FP8 block-quantized base weights (E4M3, 128x128 scales) as a frozen linear that LoRA trains on;
- `logprobs`: the fused lm_head, log-softmax gather and entropy (never a (T, V) float32 logits tensor);
- `rmsnorm`, `silu_mul`, `rotary`: the training pass's RMSNorm, SiLU product and rotary of q and k, one launch
  each way;
- `decode_gemm`, `decode_attention`: the sampler's decode step (projections with LoRA and FP8 fused in,
  attention split over each row's own length);
- `tiles`: the decode kernels' launch tiles, tuned per device as data (`tuned/*.json`), guessed elsewhere.

Kernels know no model loading (FP8-Block checkpoints: `grpo/model/fp8_checkpoint.py`). Importing this package
imports torch only: Triton is imported inside the functions that need it, and nothing probes a device at import.
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
