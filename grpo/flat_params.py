"""The adapters as views into one flat buffer, and bitsandbytes' 8-bit AdamW stepping that buffer as one tensor.

bitsandbytes' optimizers update one tensor per call: for each of Llama-3.2-1B's 224 LoRA matrices a kernel
call, its Python work and, on CUDA, a device synchronize. Here every adapter's data is a view into one flat
buffer and its `.grad` a view into one flat gradient buffer, so bitsandbytes steps a single `nn.Parameter` over
the whole buffer: one call a step. Zeroing is one op on the flat gradient, and so is clipping's multiply.

Bit for bit the per-parameter update: bitsandbytes quantizes its 8-bit state in blocks of `BLOCK` elements and
nothing in its update crosses a block. Where every adapter holds a multiple of `BLOCK` elements, each starts on
a block boundary of the flat buffer and its blocks are the ones it has on its own; where each holds at least
`min_8bit_size` elements, each has 8-bit state on its own too (smaller tensors keep 32-bit state).
`flat_refusal` says why a set of adapters does not qualify; `grpo.optim` then keeps one call per tensor.

Autograd accumulates into an existing `.grad` in place only when backward builds no graph (torch's
AccumulateGrad); a `.grad` set to None would come back as a new tensor outside the buffer. So the gradients are
zeroed in place, never set to None, and every clip and step first checks that each adapter's `.grad` and data
are still the views (`FlatParams.check`): an adapter that left the buffer would silently stop learning, so it
is an error.

Checkpoints keep the per-parameter format: `FlatOptimizer.state_dict` splits the flat state into each adapter's
and `load_state_dict` joins per-adapter state, so optimizer.pt moves between this and the per-parameter
optimizer both ways.

What it deliberately is not: a general flat-parameter framework. One dtype, one device, bitsandbytes' 8-bit
AdamW only (torch's AdamW keeps its own path); the adapters must not move or be replaced once flattened.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch
from torch import nn

BLOCK = 256  # elements per block of bitsandbytes' 8-bit state: one absmax each (Optimizer2State.init_state)
MIN_8BIT_SIZE = 4096  # bitsandbytes' default min_8bit_size; grpo.optim passes it, so the two agree

# How each entry of bitsandbytes' per-tensor state maps onto the flat buffer's.
PER_ELEMENT = ("state1", "state2")  # the two moments, one byte per element
PER_BLOCK = ("absmax1", "absmax2")  # one scale per block
SHARED = ("step", "qmap1", "qmap2")  # the same for every tensor: the step count and the quantization maps


def flat_refusal(params: Sequence[torch.Tensor], min_8bit_size: int = MIN_8BIT_SIZE) -> str | None:
    """Why one flat buffer would not step `params` bit for bit as bitsandbytes steps them one by one; None
    where it would."""
    if not params:
        return "no adapters"
    if len({id(p) for p in params}) != len(params):
        return "an adapter is listed twice"
    first = params[0]
    for i, p in enumerate(params):
        if (p.dtype, p.device) != (first.dtype, first.device):
            return f"adapters of several dtypes or devices ({first.dtype} on {first.device}, {p.dtype} on {p.device})"
        if p.numel() % BLOCK or p.numel() < min_8bit_size:
            return (f"adapter {i} of shape {tuple(p.shape)} has {p.numel()} elements, not a multiple of {BLOCK} of at "
                    f"least {min_8bit_size}")
    return None


class FlatParams:
    """`params` moved into two flat buffers: each one's data and `.grad` become views of them (its values and
    any gradient it had are copied in). `param` is the one `nn.Parameter` over the data buffer, with the flat
    gradient as its `.grad`: what the optimizer steps."""

    def __init__(self, params: Sequence[nn.Parameter]):
        self.params = list(params)
        numels = [p.numel() for p in self.params]
        self.offsets = list(accumulate(numels, initial=0))[:-1]  # each one's first element in the buffers
        first = self.params[0]
        data = torch.empty(sum(numels), dtype=first.dtype, device=first.device)
        grad = torch.zeros_like(data)
        with torch.no_grad():
            for p, at, n in zip(self.params, self.offsets, numels):
                data[at:at + n].copy_(p.reshape(-1))
                if p.grad is not None:
                    grad[at:at + n].copy_(p.grad.reshape(-1))
                p.data = data[at:at + n].view_as(p)
                p.grad = grad[at:at + n].view_as(p)
        self.param = nn.Parameter(data, requires_grad=False)  # never in a graph: autograd fills the views
        self.param.grad = grad
        self._grads = [p.grad for p in self.params]  # the views, as `check` expects to find them
        self._data_ptrs = [p.data_ptr() for p in self.params]

    @property
    def grad(self) -> torch.Tensor:
        return self.param.grad

    def zero_grad(self) -> None:
        self.param.grad.zero_()

    def check(self) -> None:
        """Raises where an adapter's `.grad` or data is no longer its view of the buffers (a `.grad` assigned or
        set to None, a backward with create_graph, a model moved or reloaded with assign=True): the optimizer
        would not see it."""
        for i, (p, grad, ptr) in enumerate(zip(self.params, self._grads, self._data_ptrs)):
            if p.grad is not grad or p.data_ptr() != ptr:
                what = "gradient" if p.grad is not grad else "data"
                raise RuntimeError(
                    f"adapter {i} of shape {tuple(p.shape)}: its {what} is no longer a view of the flat buffer, so the "
                    "optimizer would not update it; fix: zero gradients with the optimizer's zero_grad (never assign "
                    ".grad), call backward without create_graph, and move or reload the model before building the "
                    "optimizer")

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the adapters, bit for bit: the 2-norm of the per-adapter norms (one
        foreach call over the views, as torch's; one norm over the flat buffer would sum in another order and round
        otherwise), then the flat gradient scaled by torch's own coefficient in one multiply. Returns the norm."""
        self.check()
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(self._grads, 2.0)), 2.0)
        torch.nn.utils.clip_grads_with_norm_([self.param], max_norm, total)
        return total


class FlatOptimizer(torch.optim.Optimizer):
    """`optimizer` (bitsandbytes' 8-bit AdamW over `flat.param` alone) as the per-parameter optimizer over
    `flat.params` looks from outside: a schedule sets its learning rate through `param_groups`, `zero_grad`
    zeroes in place, and `state_dict` / `load_state_dict` speak the per-parameter format.

    It wraps an optimizer rather than being one (as accelerate's AcceleratedOptimizer does): torch's
    Optimizer.__init__ is not called, and `param_groups`, `state` and `defaults` are the wrapped optimizer's."""

    def __init__(self, flat: FlatParams, optimizer: torch.optim.Optimizer):
        self.flat, self.optimizer = flat, optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def step(self, closure=None):
        self.flat.check()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the flat gradient in place whatever `set_to_none` says: a gradient set to None would come back
        outside the buffer."""
        self.flat.zero_grad()

    def state_dict(self) -> dict:
        """The state that bitsandbytes' optimizer over the adapters one by one would have, each adapter's cut
        from the flat state (copies: each its own tensor in optimizer.pt, as that optimizer saves them)."""
        flat = self.optimizer.state_dict()
        (group,) = flat["param_groups"]
        state = flat["state"].get(0)
        params = self.flat.params
        per_param = {} if not state else {
            i: _split(state, at, p.numel(), p.shape) for i, (p, at) in enumerate(zip(params, self.flat.offsets))}
        return {"state": per_param, "param_groups": [{**group, "params": list(range(len(params)))}]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Per-parameter state (what `state_dict` gives, or bitsandbytes' optimizer over the adapters one by one
        saved), joined into the flat state. Raises ValueError where it does not fit these adapters."""
        groups, params = state_dict["param_groups"], self.flat.params
        if len(groups) != 1 or len(groups[0]["params"]) != len(params):
            raise ValueError(f"the optimizer state holds {[len(g['params']) for g in groups]} tensors in its groups, "
                             f"this optimizer one group of {len(params)}: it was saved for other adapters")
        (group,) = groups
        states = [state_dict["state"].get(i, {}) for i in group["params"]]
        flat_state = {}
        if any(states):  # none before the first step
            if not all(states):
                raise ValueError("the optimizer state has state for some adapters and not others; one flat buffer "
                                 "holds all or none")
            for i, (state, p) in enumerate(zip(states, params)):
                _check_sizes(state, i, p.numel())
            flat_state = {0: _join(states)}
        self.optimizer.load_state_dict({"state": flat_state, "param_groups": [{**group, "params": [0]}]})


def _split(state: dict, at: int, n: int, shape: torch.Size) -> dict:
    """One adapter's part of the flat state: elements [at, at + n), blocks [at, at + n) / BLOCK."""
    part = {}
    for key, value in state.items():
        if isinstance(value, dict):  # bitsandbytes nests its quantization state under a key of its own
            part[key] = _split(value, at, n, shape)
        elif key in PER_ELEMENT:
            part[key] = value[at:at + n].view(shape).clone()
        elif key in PER_BLOCK:
            part[key] = value[at // BLOCK:(at + n) // BLOCK].clone()
        elif key in SHARED:
            part[key] = value
        else:
            raise ValueError(f"bitsandbytes' optimizer state holds {key!r}, which the flat optimizer cannot split")
    return part


def _join(states: list[dict]) -> dict:
    """The flat state from the adapters' states, in order: the per-element and per-block entries concatenated,
    the shared ones taken once (they must agree)."""
    first = states[0]
    if any(s.keys() != first.keys() for s in states):
        raise ValueError(f"the adapters' optimizer states hold different entries ({sorted(first)} and others)")
    flat = {}
    for key, value in first.items():
        values = [s[key] for s in states]
        if isinstance(value, dict):
            flat[key] = _join(values)
        elif key in PER_ELEMENT or key in PER_BLOCK:
            if len({v.dtype for v in values}) > 1:  # 32-bit state for some adapters: not one 8-bit buffer
                raise ValueError(f"the adapters' optimizer states hold {key} in several dtypes "
                                 f"{sorted({str(v.dtype) for v in values})}; one flat buffer holds one")
            flat[key] = torch.cat([v.reshape(-1) for v in values])
        elif key in SHARED:
            if any(not _same(v, value) for v in values):
                raise ValueError(f"the adapters' optimizer states differ in {key}; one flat buffer holds one")
            flat[key] = value
        else:
            raise ValueError(f"the optimizer state holds {key!r}, which the flat optimizer cannot join")
    return flat


def _check_sizes(state: dict, i: int, n: int) -> None:
    """Adapter i's state has its n elements and n / BLOCK blocks (else the concatenation would shift them all)."""
    for key, value in state.items():
        if isinstance(value, dict):
            _check_sizes(value, i, n)
        elif key in PER_ELEMENT + PER_BLOCK:
            want = n if key in PER_ELEMENT else n // BLOCK
            if value.numel() != want:
                raise ValueError(f"the optimizer state of adapter {i} holds {value.numel()} values of {key}, the "
                                 f"adapter needs {want}: it was saved for other adapters")


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b.to(a.device)))
    return a == b
