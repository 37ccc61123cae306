# What one scaled_dot_product_attention forward and backward costs at a new sequence length, with torch's
# backends (cuDNN first on sm90) and without cuDNN's; Qwen2.5-1.5B's heads, 16 rows. Ran on the H200 2026-12-02
# (torch 2.11.0+cu130) as `PYTHONPATH=$PWD python3 sdpa_shapes.py`: sdpa.log beside it.
import time, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile, ProfilerActivity
dev = "cuda"
def run(L, B=16):
    q = torch.randn(B, 12, L, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, 2, L, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, 2, L, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.sum().backward()
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
for name, ctx in [("default", None), ("no-cudnn", NO_CUDNN)]:
    cm = sdpa_kernel(ctx) if ctx else torch.autograd.profiler.record_function("x")
    with cm:
        run(300); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(300); torch.cuda.synchronize()
        names = sorted({e.name[:90] for e in prof.events() if e.device_type.name == "CUDA"})
        print(name, "kernels:", [n for n in names if "elementwise" not in n.lower()][:8])
        for tag, widths in (("new", range(401, 433)), ("seen", [401] * 32)):
            torch.cuda.synchronize(); t = time.perf_counter()
            for L in widths:
                run(L)
            torch.cuda.synchronize()
            print(name, tag, "ms per call %.2f" % ((time.perf_counter() - t) * 1e3 / 32), flush=True)
