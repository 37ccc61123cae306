"""The native sampler: decoding in-process on the policy model itself (see `engine.py`).

- `engine.py`: `NativeEngine` (buffers, CUDA graphs, prefill, the generate loop);
- `tuning.py`: `EngineTuning`, how a step runs (benchmarks and tests choose; the product runs defaults);
- `state.py`: the engine's static buffers and the stop rule applied to them on the device;
- `layer.py`: how a Llama decoder layer runs one token per row (modules, streams, decode kernels);
- `plan.py`: which projections the decode GEMM kernels can take, and with which tensors.
"""

from grpo.rollout.native.engine import NativeEngine
from grpo.rollout.native.tuning import EngineTuning

__all__ = ["EngineTuning", "NativeEngine"]
