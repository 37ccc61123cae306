"""What a vLLM engine samples from a small random Llama, and whether its log-probs are the trainer's.

tests/test_vllm_cuda.py's Unsloth run on an FP8-Block checkpoint once gave every completion the same reward
(every completion 32 characters). This looks at one engine in isolation: it writes the
tests' model (tests/engine_runs.py, as bf16 or FP8-Block), builds the engine as the trainer
does (`--engine unsloth`: `build_engine("unsloth", None, ...)`, which loads its own policy; `--engine vllm`: `VLLMEngine` over
`load_policy`), and for vLLM without an adapter and with ours (B random, so the adapter matters) records
per case: the first rows' token ids and texts, how many distinct tokens were sampled, non-finite sampler
log-probs, and |log p_sampler - log p_trainer| with the trainer's log-probs from the policy's forward.

On the H200 machine (vLLM kit installed, benchmarks/README.md), each engine in its own process:
    source .vx/kit.sh env unsloth && python3 benchmarks/probes/engine_sampling.py --engine unsloth
    source .vx/kit.sh env && python3 benchmarks/probes/engine_sampling.py --engine vllm --checkpoint fp8-block
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # engine_runs: the tests' model

DEVICE = "cuda"  # main() says "cpu" where there is no GPU (plain vLLM's CPU build: a check of the probe itself)


def build(engine: str, path: Path, work: Path, share: float):
    """(policy, tokenizer, engine) as the trainer builds them for `engine`."""
    import torch

    from grpo.config import LORA_TARGETS, Config
    from grpo.model.load import load_policy
    from grpo.rollout import build_engine
    from grpo.rollout.unsloth import UnslothOptions

    if engine == "unsloth":
        options = UnslothOptions(model=str(path), lora_rank=8, lora_alpha=16, target_modules=LORA_TARGETS, seed=0,
                                 work_dir=str(work), gradient_checkpointing=False, gpu_memory_utilization=share,
                                 enforce_eager=True)
        unsloth = build_engine("unsloth", None, pad_id=0, max_seq_len=256, max_batch=8, unsloth=options)  # 2 x 4
        return unsloth.policy, unsloth.tokenizer, unsloth
    from grpo.rollout.vllm import VLLMEngine

    cfg = Config(model=str(path), lora_rank=8, lora_alpha=16, dtype="bf16", gradient_checkpointing=False)
    policy, tokenizer, _ = load_policy(cfg, torch.device(DEVICE))
    vllm_engine = VLLMEngine(policy, str(path), lora_rank=8, max_model_len=256, dtype="bf16", seed=0,
                             work_dir=str(work), gpu_memory_utilization=share, enforce_eager=True)
    return policy, tokenizer, vllm_engine


def report(rec, case: str, tokenizer, completions: list[list[int]], sampler, trainer) -> None:
    import torch

    width = trainer.shape[1]
    sampler = sampler.double()[:, :width]
    counted = torch.arange(width)[None, :] < torch.tensor([len(c) for c in completions])[:, None]  # not padding
    finite = torch.isfinite(sampler) & torch.isfinite(trainer) & counted
    gap = (sampler - trainer).abs()[finite]
    tokens = [t for c in completions for t in c]
    rec.record("case", case=case, rows=len(completions), tokens=len(tokens), distinct_tokens=len(set(tokens)),
               share_of_token_0=tokens.count(0) / max(len(tokens), 1),
               sampler_nonfinite=int((~torch.isfinite(sampler) & counted).sum()),
               trainer_nonfinite=int((~torch.isfinite(trainer) & counted).sum()),
               gap_mean=float(gap.mean()) if gap.numel() else None, gap_max=float(gap.max()) if gap.numel() else None,
               first_ids=[c[:12] for c in completions[:2]],
               first_texts=[tokenizer.decode(c) for c in completions[:2]])


def main() -> None:
    from timing import Recorder, add_out_argument

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--engine", choices=["unsloth", "vllm"], default="unsloth",
                        help="the trainer's --engine to build (default: unsloth)")
    parser.add_argument("--checkpoint", choices=["fp8-block", "bf16"], default="fp8-block",
                        help="how the small random Llama is stored (default: fp8-block, the test's)")
    parser.add_argument("--share", type=float, default=0.3, help="vLLM's share of the GPU (default: 0.3)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per completion (default: 16)")
    add_out_argument(parser)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")  # minutes of DeepGEMM JIT for shapes never used here

    global DEVICE
    import torch
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from engine_runs import PROMPTS, trainer_logp, write_small_llama
    from grpo.assets import llama_tokenizer_dir
    from grpo.rollout.base import Sampling

    DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    rec = Recorder(f"engine_sampling-{args.engine}-{args.checkpoint}", args.out)
    work = Path(tempfile.mkdtemp(prefix="engine-probe-"))
    path = write_small_llama(args.checkpoint, work / args.checkpoint,
                             AutoTokenizer.from_pretrained(llama_tokenizer_dir()))
    policy, tokenizer, engine = build(args.engine, path, work / "engine", args.share)
    rec.record("built", engine=args.engine, checkpoint=args.checkpoint, vllm_logprob_semantics=engine.logprob_semantics)

    # vLLM with no adapter: the base weights alone, against the policy with its adapter off.
    params = [SamplingParams(n=4, temperature=1.0, max_tokens=args.tokens, logprobs=0, seed=17 + i, ignore_eos=True,
                             detokenize=False) for i in range(len(PROMPTS))]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = (policy.fast_generate(prompts, sampling_params=params, use_tqdm=False) if args.engine == "unsloth"
               else engine.llm.generate(prompts, params, use_tqdm=False))
    completions = [list(c.token_ids) for out in outputs for c in out.outputs]
    sampler = torch.tensor([[next(iter(e.values())).logprob for e in c.logprobs] for out in outputs
                            for c in out.outputs], dtype=torch.float64)
    with policy.disable_adapter():
        trainer = trainer_logp(policy, PROMPTS, completions, 4)
    report(rec, "no adapter", tokenizer, completions, sampler, trainer)

    # Ours: the engine's generate with the policy's adapter, B random so that it changes the model.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    rollout = engine.generate(PROMPTS, 4, Sampling(max_new_tokens=args.tokens, temperature=1.0))
    completions = rollout.completions()
    report(rec, "our adapter", tokenizer, completions, rollout.sampler_logp,
           trainer_logp(policy, PROMPTS, completions, 4))


if __name__ == "__main__":
    main()
