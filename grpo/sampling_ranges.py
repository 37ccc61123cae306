"""The sampling numbers' ranges, stated once: `grpo.rollout.Sampling` checks them, and so does the command
line (`grpo.config`) before any model loads, each error in its caller's spelling.

What it deliberately is not: sampling. It sits outside `grpo.rollout` because the command line reads it,
and the engines read the command line's `Config`.
"""

from __future__ import annotations

from collections.abc import Callable

GREEDY_EPS = 1e-5  # vLLM treats temperatures below this as greedy (grpo.rollout.vllm, grpo.vllm_logits)


def spell_field(name: str, value: object) -> str:
    """`Sampling.top_p=1.5`: as a caller of `Sampling` writes it."""
    return f"Sampling.{name}={value}"


def check_sampling_numbers(*, top_p: float, min_p: float,
                           spell: Callable[[str, object], str] = spell_field) -> None:
    """top_p in (0, 1] (1 is off) and min_p in [0, 1) (0 is off); a ValueError naming the number as `spell`
    writes it."""
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"{spell('top_p', top_p)}: must be in (0, 1]; 1 switches it off")
    if not 0.0 <= min_p < 1.0:
        raise ValueError(f"{spell('min_p', min_p)}: must be in [0, 1); 0 switches it off")
