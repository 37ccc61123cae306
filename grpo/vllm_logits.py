"""The logits processor that makes vLLM report the trainer's log-probabilities, log softmax(logits / T).

vLLM loads it by its qualified name (`grpo.rollout.vllm.LOGITS_PROCESSOR`) in whichever process runs its engine
core, so it lives in a module of its own that subclasses vLLM's class at import, outside `grpo.rollout`: that
process imports torch and vllm for it, not the other engines. Only vLLM imports this module: importing
`grpo.rollout.vllm` does not import vllm.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor, MoveDirectionality

from grpo.sampling_ranges import GREEDY_EPS


class LogSoftmaxAtTemperature(LogitsProcessor):
    """Shifts each row of logits by T * logsumexp(logits / T), T being that request's temperature.

    A constant per row changes no probability, no min-p/top-k/top-p decision and no argmax, but
    after vLLM's division by T the row is exactly log softmax(logits / T), so the
    "processed_logits" vLLM returns for the sampled token is its untruncated log-probability.
    Runs before the temperature (it is not argmax-invariant in vLLM's sense: it must also run for
    greedy rows, which take T = 1 here, so they report log softmax(logits)).
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.temperature: dict[int, float] = {}  # batch index -> temperature
        self._rows: torch.Tensor | None = None  # (B,) cached per-row temperatures

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Any) -> None:
        if batch_update is None:
            return
        # vLLM's documented order: removed, added, moved.
        for index in batch_update.removed:
            self.temperature.pop(index, None)
        for index, params, _prompt_ids, _output_ids in batch_update.added:
            t = float(params.temperature)
            self.temperature[index] = t if t >= GREEDY_EPS else 1.0
        for a, b, direction in batch_update.moved:
            t_a, t_b = self.temperature.pop(a, None), self.temperature.pop(b, None)
            if t_a is not None:
                self.temperature[b] = t_a
            if direction == MoveDirectionality.SWAP and t_b is not None:
                self.temperature[a] = t_b
        self._rows = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows = logits.shape[0]
        if self._rows is None or self._rows.shape[0] != rows:
            temps = torch.ones(rows, dtype=torch.float32)
            for index, t in self.temperature.items():
                if index < rows:
                    temps[index] = t
            self._rows = temps.to(logits.device)
        temps = self._rows.to(logits.dtype).unsqueeze(-1)  # (B, 1)
        shift = torch.logsumexp(logits / temps, dim=-1, keepdim=True) * temps  # (B, 1)
        return logits.sub_(shift)
