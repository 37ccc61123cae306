"""The native sampler: decoding in-process on the policy model itself (see `engine.py`).

- `engine.py`: `NativeEngine` (buffers, CUDA graphs, prefill, the generate loop);
- `tuning.py`: `EngineTuning`, how a step runs where the device does not decide it (the product's defaults);
- `state.py`: the engine's static buffers and the stop rule applied to them on the device;
- `layer.py`: how a Llama decoder layer runs one token per row (modules, streams, decode kernels, packed);
- `plan.py`: which projections the decode GEMM kernels can take, and with which tensors;
- `packed.py`: the projections of steps wider than the kernels take, as torch's GEMMs with the adapters packed;
- `fold.py`: the adapters folded into the base weights for a generate, and taken out exactly.
"""

from grpo.rollout.native.engine import NativeEngine
from grpo.rollout.native.tuning import EngineTuning

__all__ = ["EngineTuning", "NativeEngine"]
