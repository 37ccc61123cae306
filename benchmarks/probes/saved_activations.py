"""Bytes one Llama-3.2-1B decoder layer saves for backward, with rsLoRA on its 7 projections (CPU).

Under gradient checkpointing a training pass holds each layer's input and, during the backward of one
layer, that layer's recomputed activations: this script measures the second part exactly (the tensors
autograd saves, counted once per storage, parameters excluded), which does not depend on the device.
It compares peft's default float32 adapters (its input is cast to float32 and saved), the trainer's
`--lora-compute base` (float32 adapters multiplied in bf16), adapters stored in bf16, and the trainer's
defaults: `--lora-compute base` with `grpo.model.lean_activations` (SiLU's output and the norms' float32 copies
not saved).

    PYTHONPATH=$PWD python benchmarks/probes/saved_activations.py [--tokens 2048]

Scale by the tokens of one micro-batch: the long config trains 16 x 2048 tokens in one pass.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from grpo.config import LORA_TARGETS

VARIANTS = {"float32": "float32 adapters (peft's default)", "base": "float32 adapters, bf16 matmuls "
            "(--lora-compute base)", "bf16": "bf16 adapters", "lean": "float32 adapters, bf16 matmuls, "
            "the lean MLP product and norms (the trainer's defaults: grpo.model.lean_activations)"}


def saved_bytes(tokens: int, variant: str) -> dict[str, int]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=1, vocab_size=1000)
    cfg._attn_implementation = "sdpa"

    class OneLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16)
            self.rope = LlamaRotaryEmbedding(cfg)

        def forward(self, x):
            pos = torch.arange(x.shape[1])[None]
            return self.layer(x, position_embeddings=self.rope(x, pos), attention_mask=None, position_ids=pos)

    torch.manual_seed(0)
    lora = LoraConfig(r=32, lora_alpha=64, use_rslora=True, target_modules=list(LORA_TARGETS), lora_dropout=0.0)
    model = get_peft_model(OneLayer(), lora, autocast_adapter_dtype=variant != "bf16")
    if variant in ("base", "lean"):
        from grpo.model.load import compute_adapters_in_base_dtype

        compute_adapters_in_base_dtype(model)
    if variant == "lean":
        from grpo.model import lean_activations

        lean_activations.install(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randn(1, tokens, 2048, dtype=torch.bfloat16, requires_grad=True)
    params.add(x.untyped_storage().data_ptr())  # the layer input: the checkpoint holds it anyway
    seen: dict[int, tuple[int, torch.dtype]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = (t.untyped_storage().nbytes(), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    out = {"total": sum(n for n, _ in seen.values())}
    for n, dtype in seen.values():
        out[str(dtype).removeprefix("torch.")] = out.get(str(dtype).removeprefix("torch."), 0) + n
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="Tokens in the layer's input.")
    args = parser.parse_args()
    mib = 2**20
    for variant, name in VARIANTS.items():
        got = saved_bytes(args.tokens, variant)
        parts = ", ".join(f"{k} {v / mib:.0f}" for k, v in got.items() if k != "total")
        print(f"{name}: {got['total'] / mib:.0f} MiB saved for backward over {args.tokens} tokens "
              f"({parts} MiB by dtype)")


if __name__ == "__main__":
    main()
