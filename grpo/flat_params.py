"""The adapters as views into one flat buffer, and bitsandbytes' 8-bit AdamW stepping that buffer as one tensor.

bitsandbytes' optimizers update one tensor per call: for each of Llama-3.2-1B's 224 LoRA matrices a kernel
call, its Python work and, on CUDA, a device synchronize. Here every adapter's data is a view into one flat
buffer, so bitsandbytes steps a single `nn.Parameter` over the whole buffer: one call a step. Its gradient is the
adapters' own gradients gathered into one tensor for the step (`FlatParams.gather_grads`, one copy) and dropped
after it: autograd keeps filling each adapter's `.grad` as it always does, so the training pass holds no gradient
it would not hold anyway (gradients kept as views of a second buffer would all be held, zeros, from the pass's
first op, through its peak).

Bit for bit the per-parameter update: bitsandbytes quantizes its 8-bit state in blocks of `BLOCK` elements and
nothing in its update crosses a block. Where every adapter holds a multiple of `BLOCK` elements, each starts on
a block boundary of the flat buffer and its blocks are the ones it has on its own; where each holds at least
`min_8bit_size` elements, each has 8-bit state on its own too (smaller tensors keep 32-bit state).
`flat_refusal` says why a set of adapters does not qualify; `grpo.optim` then keeps one call per tensor.

Every clip and step first checks that each adapter's data is still its view of the buffer (`FlatParams.check`):
an adapter moved or reloaded after the optimizer was built would silently stop learning, so it is an error.

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
    """`params` moved into one flat buffer: each one's data becomes a view of it (its values copied in). `param`
    is the one `nn.Parameter` over the buffer, what the optimizer steps; its `.grad` is the adapters' gradients
    gathered for a step (`gather_grads`), None between steps."""

    def __init__(self, params: Sequence[nn.Parameter]):
        self.params = list(params)
        numels = [p.numel() for p in self.params]
        self.offsets = list(accumulate(numels, initial=0))[:-1]  # each one's first element in the buffer
        first = self.params[0]
        data = torch.empty(sum(numels), dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, at, n in zip(self.params, self.offsets, numels):
                data[at:at + n].copy_(p.reshape(-1))
                p.data = data[at:at + n].view_as(p)
        self.param = nn.Parameter(data, requires_grad=False)  # never in a graph: the adapters are
        self._data_ptrs = [p.data_ptr() for p in self.params]

    @property
    def grad(self) -> torch.Tensor | None:
        return self.param.grad

    def check(self) -> None:
        """Raises where an adapter's data is no longer its view of the buffer (a model moved, or reloaded with
        assign=True, after the optimizer was built): the optimizer would not update it."""
        for i, (p, ptr) in enumerate(zip(self.params, self._data_ptrs)):
            if p.data_ptr() != ptr:
                raise RuntimeError(
                    f"adapter {i} of shape {tuple(p.shape)}: its data is no longer a view of the flat buffer, so the "
                    "optimizer would not update it; fix: move or reload the model before building the optimizer")

    def gather_grads(self) -> None:
        """The adapters' gradients, in the buffer's order, as the flat parameter's `.grad` (one copy). An adapter
        without one is an error: a per-tensor optimizer would leave it as it is, and one flat step cannot."""
        self.check()
        missing = [i for i, p in enumerate(self.params) if p.grad is None]
        if missing:
            p = self.params[missing[0]]
            raise RuntimeError(f"adapter {missing[0]} of shape {tuple(p.shape)}: no gradient ({len(missing)} of "
                               f"{len(self.params)} have none): one flat step updates every adapter, so each needs one; "
                               "fix: run backward through every adapter before the step, or zero the missing ones")
        self.param.grad = torch.cat([p.grad.reshape(-1) for p in self.params])

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the adapters, bit for bit: the 2-norm of the per-adapter norms (one
        foreach call, as torch's; one norm over the flat gradient would sum in another order and round otherwise),
        then the gathered gradient scaled by torch's own coefficient in one multiply. Returns the norm."""
        self.gather_grads()
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in self.params], 2.0)), 2.0)
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
        """One bitsandbytes call over the buffer, with the gradients `clip_grad_norm_` gathered (gathered here
        where no clip did); the gathered copy is dropped after."""
        if self.flat.grad is None:
            self.flat.gather_grads()
        try:
            return self.optimizer.step(closure)
        finally:
            self.flat.param.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The adapters' gradients set to None (or zeroed), as torch's optimizers do, and any gathered copy dropped."""
        for p in self.flat.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        self.flat.param.grad = None

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
