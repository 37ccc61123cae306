"""The reference engine: transformers `generate` on the policy itself.

Slow (one un-graphed forward per token) but simple and close to what users already trust; the native
engine is tested against it. It shares the policy's weights, adapters active, and is not a copy.
"""

from __future__ import annotations

import time

import torch

from grpo.rollout.base import Rollout, Sampling
from grpo.rollout.stops import first_stop_index


class HFEngine:
    def __init__(self, model, *, pad_id: int):
        self.model = model
        self.pad_id = pad_id

    def release_memory(self) -> None:
        """transformers allocates its cache per call: nothing is held between generations."""

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Rollout:
        from transformers import GenerationConfig

        t0 = time.perf_counter()
        device = next(self.model.parameters()).device
        rows = [p for p in prompt_ids for _ in range(n)]  # group order: row i is prompt i // n
        width = max(len(p) for p in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, p in enumerate(rows):  # left padding, as decoder-only generation needs
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention_mask[i, width - len(p):] = 1
        greedy = sampling.temperature == 0
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy or sampling.top_p >= 1 else sampling.top_p,
            top_k=None if greedy or sampling.top_k <= 0 else sampling.top_k,
            min_p=None if greedy or sampling.min_p <= 0 else sampling.min_p,
            eos_token_id=None if sampling.ignore_eos else list(sampling.stop_token_ids) or None,
            pad_token_id=self.pad_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                      generation_config=config)
        finally:
            self.model.train(was_training)
        completion_ids = out.sequences[:, width:].cpu()  # (P*n, T)
        logits = torch.stack(out.logits, dim=1).float().cpu()  # (P*n, T, V) raw logits
        logp_all = torch.log_softmax(logits / (sampling.temperature or 1.0), dim=-1)
        sampler_logp = logp_all.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
        mask, finished = _stop_mask(completion_ids, sampling)
        return Rollout(
            prompt_ids=[list(p) for p in prompt_ids],
            completion_ids=completion_ids.masked_fill(~mask, self.pad_id),
            mask=mask,
            sampler_logp=sampler_logp.masked_fill(~mask, 0.0),
            finished=finished,
            n=n,
            timings={"generate": time.perf_counter() - t0},
        )


def _stop_mask(completion_ids: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """mask (B, T) True up to and including each row's first stop; finished (B,) where a stop was hit."""
    B, T = completion_ids.shape
    mask = torch.ones((B, T), dtype=torch.bool)
    finished = torch.zeros(B, dtype=torch.bool)
    stop_ids = () if sampling.ignore_eos else sampling.stop_token_ids
    for i, row in enumerate(completion_ids.tolist()):
        end = first_stop_index(row, stop_ids, sampling.stop_sequences)
        if end is not None:
            mask[i, end + 1:] = False
            finished[i] = True
    return mask, finished
