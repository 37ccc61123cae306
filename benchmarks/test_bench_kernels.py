"""The kernels at the sizes of a bench-config step: FP8Linear, token_logprobs, the 8-bit AdamW step.

- FP8Linear forward + input-gradient backward (no weight gradient: the base is frozen) for each
  Llama-3.2-1B projection shape, beside bf16 nn.Linear, at M = 16 x 640 tokens (the step's rows).
  4*M*N*K flops per call.
- token_logprobs at N = 16 x 512 completion tokens, V = 128256, H = 2048: forward only (reference
  and old log-probs) and forward + backward (the loss); 2*N*V*H flops per product.
- The optimizer step (clip_grad_norm_ + bitsandbytes AdamW8bit) over the rsLoRA r=32 adapters of the
  7 projections: the trainer's "train" phase includes it, so this separates it out.

Inputs are random (never zeros); every timed call ends in a CUDA synchronize.
"""

from __future__ import annotations

import pytest

import bench_setup as bs

# (out_features N, in_features K) of the Llama-3.2-1B projections.
PROJECTIONS = {"q_o": (2048, 2048), "k_v": (512, 2048), "gate_up": (8192, 2048), "down": (2048, 8192)}


def _sizes(bench_env) -> dict:
    shape = bench_env.bench
    if bench_env.smoke:
        return {"M": 256, "N_tok": 128, "V": 4096, "H": 256, "layers": 1, "scale": 1 / 8}
    return {"M": shape.rows * shape.seq_len, "N_tok": shape.rows * shape.completion_len, "V": 128256, "H": 2048,
            "layers": 16, "scale": 1}


@pytest.mark.bench_order(10)
@pytest.mark.bench_cost(3)
@pytest.mark.parametrize("impl", ["bf16", "fp8"])
@pytest.mark.parametrize("proj", list(PROJECTIONS))
def test_linear_forward_backward(benchmark, bench_env, results, proj, impl):
    import torch
    from torch import nn

    from grpo.kernels.fp8 import FP8Linear

    sizes = _sizes(bench_env)
    n, k = (max(128, int(d * sizes["scale"])) for d in PROJECTIONS[proj])
    m = sizes["M"]
    dev, dt = bench_env.device, torch.bfloat16 if bench_env.cuda else torch.float32
    torch.manual_seed(0)
    layer = nn.Linear(k, n, bias=False, device=dev, dtype=dt).requires_grad_(False)
    if impl == "fp8":
        layer = FP8Linear.from_linear(layer)
    x = torch.randn(m, k, device=dev, dtype=dt, requires_grad=True)
    grad = torch.randn(m, n, device=dev, dtype=dt)

    def step():
        x.grad = None
        layer(x).backward(grad)
        bs.sync()

    bs.free_memory()
    benchmark.pedantic(step, rounds=bench_env.rounds(20), warmup_rounds=bench_env.rounds(3), iterations=1)
    median = benchmark.stats.stats.median if benchmark.stats else None
    benchmark.extra_info.update({"M": m, "N": n, "K": k, "flops": 4 * m * n * k, **bs.memory_info(),
                                 "tflops": 4 * m * n * k / median / 1e12 if median else None})
    results.add(benchmark, group="kernel", config=f"linear-{proj}", impl="ours", dtype=impl)


@pytest.mark.bench_order(11)
@pytest.mark.bench_cost(5)
@pytest.mark.parametrize("mode", ["forward", "forward_backward"])
def test_token_logprobs(benchmark, bench_env, results, mode):
    import torch

    from grpo.kernels.logprobs import token_logprobs

    sizes = _sizes(bench_env)
    n, v, h = sizes["N_tok"], sizes["V"], sizes["H"]
    dev, dt = bench_env.device, torch.bfloat16 if bench_env.cuda else torch.float32
    torch.manual_seed(0)
    weight = (torch.randn(v, h, device=dev) * 0.02).to(dt)
    hidden = torch.randn(n, h, device=dev).to(dt).requires_grad_(mode == "forward_backward")
    targets = torch.randint(0, v, (n,), device=dev)
    grad = torch.randn(n, device=dev)

    def run():
        if mode == "forward":
            with torch.no_grad():
                token_logprobs(hidden, weight, targets)
        else:
            hidden.grad = None
            token_logprobs(hidden, weight, targets).backward(grad)
        bs.sync()

    bs.free_memory()
    benchmark.pedantic(run, rounds=bench_env.rounds(10), warmup_rounds=bench_env.rounds(2), iterations=1)
    products = 1 if mode == "forward" else 2
    median = benchmark.stats.stats.median if benchmark.stats else None
    benchmark.extra_info.update({"N": n, "V": v, "H": h, "flops": 2 * products * n * v * h, **bs.memory_info(),
                                 "tflops": 2 * products * n * v * h / median / 1e12 if median else None,
                                 "note": "flops count the logits products only (forward; backward adds dH)"})
    results.add(benchmark, group="kernel", config="token_logprobs", impl="ours", dtype=mode)


@pytest.mark.bench_order(12)
@pytest.mark.bench_cost(4)
def test_adamw_8bit_step_over_lora_adapters(benchmark, bench_env, results):
    """clip_grad_norm_ + AdamW8bit.step over the adapters' fp32 parameters (peft keeps them in fp32)."""
    bnb = pytest.importorskip("bitsandbytes", reason="8-bit AdamW needs bitsandbytes: pip install bitsandbytes")
    import torch

    sizes = _sizes(bench_env)
    r, dev = 32, bench_env.device
    torch.manual_seed(0)
    params = []
    for _ in range(sizes["layers"]):
        for n, k in (PROJECTIONS["q_o"], PROJECTIONS["k_v"], PROJECTIONS["k_v"], PROJECTIONS["q_o"],
                     PROJECTIONS["gate_up"], PROJECTIONS["gate_up"], PROJECTIONS["down"]):
            n, k = max(128, int(n * sizes["scale"])), max(128, int(k * sizes["scale"]))
            for shape in ((r, k), (n, r)):  # lora_A, lora_B
                p = torch.nn.Parameter(torch.randn(shape, device=dev) * 0.01)
                p.grad = torch.randn(shape, device=dev) * 1e-3
                params.append(p)
    opt = bnb.optim.AdamW8bit(params, lr=5e-6, weight_decay=0.001, betas=(0.9, 0.99))

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        bs.sync()

    bs.free_memory()
    benchmark.pedantic(step, rounds=bench_env.rounds(20), warmup_rounds=bench_env.rounds(3), iterations=1)
    count = sum(p.numel() for p in params)
    median = benchmark.stats.stats.median if benchmark.stats else None
    benchmark.extra_info.update({"params": count, **bs.memory_info(),
                                 # read p, g, two 8-bit states; write p and the states
                                 "achieved_gb_per_s": count * (4 + 4 + 2 + 4 + 2) / median / 1e9 if median else None})
    results.add(benchmark, group="kernel", config="adamw_8bit", impl="ours", dtype="fp32")
