"""Checks shared by the loss functions: one-line ValueErrors that name the input and the fix. Each option's
choices live beside the function that takes them; a policy term checks its own knobs.

Every check here looks at metadata only (shape, dtype, Python numbers), never at tensor values, so
none of them synchronizes with the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is unknown; choose one of {', '.join(repr(c) for c in choices)}")


def shape_str(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_same_shape(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    check_tensor(name, t)
    if t.shape != ref.shape:
        raise ValueError(f"{name} has shape {shape_str(t)} but {ref_name} has shape {shape_str(ref)}; "
                         "they must match")


def check_logp(name: str, logp: torch.Tensor) -> None:
    """A (B, T) floating tensor with at least one row and one position."""
    check_tensor(name, logp)
    if logp.dim() != 2:
        raise ValueError(f"{name} has shape {shape_str(logp)}; expected (B, T): one row per completion, "
                         "one column per completion token")
    if not logp.is_floating_point():
        raise ValueError(f"{name} has dtype {logp.dtype}; log-probabilities must be a floating dtype")
    if logp.shape[0] == 0 or logp.shape[1] == 0:
        raise ValueError(f"{name} has shape {shape_str(logp)}; need at least one row and one token position")


def check_mask(mask: torch.Tensor, logp: torch.Tensor) -> None:
    check_same_shape("mask", mask, "logp", logp)
    if mask.dtype != torch.bool:
        raise ValueError(f"mask has dtype {mask.dtype}; pass a bool tensor that is True where a completion "
                         "token counts (e.g. mask.bool())")


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype to do the arithmetic in: the widest input dtype, and at least float32.

    bf16/fp16 log-probabilities are upcast: exp() of a bf16 log-ratio has 3 significant digits,
    too coarse to tell a ratio of 1.0 from the clip boundary 1.2 reliably.
    """
    out = torch.float32
    for dt in dtypes:
        if dt.is_floating_point:
            out = torch.promote_types(out, dt)
    return out
