"""The reference engine: transformers `generate` on the policy itself.

Slow (one un-graphed forward per token) but simple and close to what users already trust; the native
engine is tested against it. It shares the policy's weights, adapters active, and is not a copy.

A prompt longer than `prefill_chunk` tokens is prefilled a chunk at a time (transformers'
`prefill_chunk_size`): the largest single operation then spans one chunk, not the whole prompt, so that
a second Ctrl-C, which Python raises between operations, stops even a long CPU prefill within seconds.
"""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig, StoppingCriteriaList

from grpo.rollout.base import GenerationProgress, Rollout, Sampling, pad_rows
from grpo.rollout.stops import first_stop_index


# Prompt tokens a prefill reads at once: it trades a little prefill speed for a second Ctrl-C that stops a
# long prompt's prefill within one chunk (docs/measurements.md, "A long prefill and Ctrl-C").
PREFILL_CHUNK = 256


class HFEngine:
    # Sampled by the policy's own modules: its log-probs are the trainer's numerics.
    needs_importance_correction = False

    def __init__(self, model, *, pad_id: int, progress: GenerationProgress | None = None,
                 prefill_chunk: int = PREFILL_CHUNK):
        self.model = model
        self.pad_id = pad_id
        self.progress = progress  # told rows x decode steps as they are done; the trainer sets it
        self.prefill_chunk = prefill_chunk

    def release_memory(self) -> None:
        """transformers allocates its cache per call: nothing is held between generations."""

    def standby_bytes(self) -> None:
        """None: `--engine-standby auto` releases it, as it does every engine but a small native one."""
        return None

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], num_generations: int, sampling: Sampling) -> Rollout:
        t0 = time.perf_counter()
        device = next(self.model.parameters()).device
        rows = [p for p in prompt_ids for _ in range(num_generations)]  # group order: row i is prompt i // G
        # left padding, as decoder-only generation needs
        input_ids = pad_rows(rows, self.pad_id, dtype=torch.long, left=True)
        attention_mask = pad_rows([[1] * len(p) for p in rows], 0, dtype=torch.long, left=True)
        width = input_ids.shape[1]  # the longest prompt
        greedy = sampling.temperature == 0
        # Every knob explicit: transformers fills what is left unset from the model's own generation
        # config (Llama 3 instruct: top_p 0.9, top_k 50), which would sample another distribution.
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            temperature=1.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=0 if greedy else sampling.top_k,
            min_p=None if greedy or sampling.min_p <= 0 else sampling.min_p,
            repetition_penalty=1.0,
            # ignore_eos: every row runs to max_new_tokens (the EOS token is masked out, the only way
            # transformers offers; the other engines leave its probability as it is).
            min_new_tokens=sampling.max_new_tokens if sampling.ignore_eos else 0,
            eos_token_id=list(sampling.stop_token_ids) or None,
            pad_token_id=self.pad_id,
            output_logits=True,
            return_dict_in_generate=True,
            prefill_chunk_size=self.prefill_chunk if width > self.prefill_chunk else None,
        )
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        was_training = self.model.training
        self.model.eval()
        try:
            streamer = None if self.progress is None else _DecodeSteps(self.progress, len(rows), sampling.max_new_tokens)
            # Rows end at a stop sequence too (transformers knows only stop ids), so decoding ends once all have.
            stops = [] if sampling.ignore_eos or not sampling.stop_sequences else [_StopSequences(sampling, width)]
            out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                      generation_config=config, streamer=streamer,
                                      stopping_criteria=StoppingCriteriaList(stops))
        finally:
            self.model.train(was_training)
        completion_ids = out.sequences[:, width:]  # (P*G, T)
        # One step at a time: a (P*G, T, V) fp32 tensor would be gigabytes at Llama's vocabulary.
        inv_t = 1.0 / (sampling.temperature or 1.0)
        sampler_logp = torch.stack([
            torch.log_softmax(step_logits.float() * inv_t, dim=-1).gather(-1, completion_ids[:, t, None]).squeeze(-1)
            for t, step_logits in enumerate(out.logits)], dim=1).cpu()  # (P*G, T)
        completion_ids = completion_ids.cpu()
        mask, finished = _stop_mask(completion_ids, sampling)
        return Rollout(
            prompt_ids=[list(p) for p in prompt_ids],
            completion_ids=completion_ids.masked_fill(~mask, self.pad_id),
            mask=mask,
            sampler_logp=sampler_logp.masked_fill(~mask, 0.0),
            finished=finished,
            num_generations=num_generations,
            timings={"generate": time.perf_counter() - t0},
        )


class _StopSequences:
    """A transformers stopping criterion: a row is done once its completion ends with a stop sequence.

    The tokens kept are the same as without it (`_stop_mask` cuts each row after its first stop); it
    only spares the decode steps that would run until every row had also met a stop id or the limit.
    """

    def __init__(self, sampling: Sampling, prompt_width: int):
        self.sequences = [torch.tensor(seq) for seq in sampling.stop_sequences if seq]
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        generated = input_ids.shape[1] - self.prompt_width
        for seq in self.sequences:
            if len(seq) <= generated:
                done |= (input_ids[:, -len(seq):] == seq.to(input_ids.device)).all(dim=-1)
        return done


class _DecodeSteps:
    """A transformers streamer that reports rows x decode steps to a `GenerationProgress`.

    transformers hands it the prompt first, then each step's new tokens (one per row), then calls end().
    """

    def __init__(self, progress: GenerationProgress, rows: int, max_new_tokens: int):
        self.progress = progress
        self.rows = rows
        self.total = rows * max_new_tokens
        self.steps = -1  # the first put() is the prompt

    def put(self, value) -> None:
        self.steps += 1
        self.progress(self.rows * self.steps, self.total)

    def end(self) -> None:
        self.progress(self.total, self.total)


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
