"""What each GGUF type costs a trained model: held-out GSM8K accuracy, the perplexity of the reference
solutions and greedy agreement with the merged 16-bit model, per `--gguf` type.

    # GPU: the packaged Qwen with a trained adapter, GSM8K's 319 held-out problems
    python benchmarks/probes/gguf_quality.py --adapter outputs/qwen1.5b-gsm8k/adapter --out /tmp/gguf-quality
    # CPU smoke run: SmolLM2 without an adapter, 8 problems, 48 tokens (a few minutes on 2 cores)
    python benchmarks/probes/gguf_quality.py --smoke --out /tmp/gguf-quality-smoke

Each GGUF is written as `grpo.export.merge --gguf` writes it (from the base when no --adapter), read back by
transformers (`gguf_file=`, dequantized) and saved as a bf16 checkpoint (`grpo.model.packaged.
convert_gguf`), so every type is evaluated by the same `grpo.eval` code and engine as the merged model.
Per type: `eval/greedy_accuracy` (strict, in <SOLUTION>), `eval/greedy_lenient_accuracy`, format; on the
first `--agreement-prompts` problems, the share of greedy completions token-for-token equal to the merged
model's and the perplexity of the merged model's greedy completions under this type; the file size.
Results: OUT/results.json, one line per type on stdout. Writing a k-quant type of the 1.5B model takes
about 6 minutes of CPU, spread over every core (grpo.export.gguf's worker processes): under a per-command
time limit, run `--write-only` first; a rerun reuses the merge and the files already written.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="Base model (as train.py's --model).")
    parser.add_argument("--adapter", default=None, help="Trained adapter folder; without it the base is exported.")
    parser.add_argument("--types", default=None,
                        help="GGUF types, comma-separated (default: f16,q8_0,q5_k_m,q4_k_m; with --smoke f16,q4_k_m).")
    parser.add_argument("--out", required=True, help="Work folder (the export and the converted checkpoints).")
    parser.add_argument("--dataset", default="gsm8k", help="Held-out split evaluated (grpo.data).")
    parser.add_argument("--eval-size", type=int, default=319, help="Held-out problems (GSM8K holds out 319).")
    parser.add_argument("--max-completion-length", type=int, default=384,
                        help="Completion tokens at most (the qwen1.5b-gsm8k preset's).")
    parser.add_argument("--agreement-prompts", type=int, default=32, help="Prompts whose greedy tokens are compared.")
    parser.add_argument("--max-prompt-length", type=int, default=288,
                        help="Held-out prompts longer than this are dropped (the qwen1.5b-gsm8k preset's).")
    parser.add_argument("--stop", nargs="*", default=["</SOLUTION>"],
                        help="Stop strings of the held-out evaluation (default: the recipes' '</SOLUTION>').")
    parser.add_argument("--write-only", action="store_true",
                        help="Export and write the GGUF files, evaluate nothing (a later run without it reuses "
                             "them): the writing and the evaluation can then go in separate commands.")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU smoke run: smollm2-135m-instruct, 8 problems, 48 tokens, f16 and q4_k_m.")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.eval_size, args.max_completion_length = "smollm2-135m-instruct", 8, 48
        args.agreement_prompts = 4
    args.types = args.types or ("f16,q4_k_m" if args.smoke else "f16,q8_0,q5_k_m,q4_k_m")
    return args


def export_ggufs(args, out: Path) -> tuple[Path, dict[str, Path]]:
    """The merged checkpoint (or the base's folder) and one GGUF per type, each written once: a rerun
    reuses the merge and the files already there (so the types can be written one command at a time)."""
    from grpo.export.merge import export
    from grpo.export.gguf import gguf_file_name, parse_gguf_types, write_gguf
    from grpo.model.load import resolve_model_dir

    folder = out / "export"
    if args.adapter and not (folder / "merged" / "config.json").is_file():
        export(args.model, args.adapter, folder, overwrite=True)  # the adapter and the merged checkpoint
    merged = folder / "merged" if args.adapter else resolve_model_dir(args.model)
    paths = {}
    for name in parse_gguf_types(args.types):
        path = folder / f"gguf-{name}" / gguf_file_name(name)
        paths[name] = path if path.is_file() else write_gguf(merged, path, name)
    return merged, paths


def eval_flags(model_dir: Path, args) -> argparse.Namespace:
    """The flags of `python -m grpo.eval` for one checkpoint, parsed by its own parser (so they cannot drift
    from what it reads): greedy only, as the qwen1.5b-gsm8k preset's trainer evaluates by default (its stop
    string, prompts up to 288 tokens, 64 completions a call)."""
    from grpo.eval.cli import build_parser

    return build_parser().parse_args(
        ["--model", str(model_dir), "--dataset", args.dataset, "--eval-size", str(args.eval_size), "--samples", "0",
         "--max-completion-length", str(args.max_completion_length),
         "--max-prompt-length", str(args.max_prompt_length), "--batch-rows", "64", "--seed", "3407",
         "--stop", *args.stop])


def greedy_completions(model, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Every prompt's greedy completion, all in one batched `generate` (grpo's HFEngine: left-padded; one
    call a prompt took minutes on a GPU), each cut after its first end token (not at the stop string: the
    agreement is the models' whole greedy text)."""
    from grpo.rollout.base import Sampling
    from grpo.rollout.hf import HFEngine
    from grpo.rollout.stops import stop_token_ids

    ends = stop_token_ids(tokenizer, model.generation_config)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ends[0]  # masked: any id does
    sampling = Sampling(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=ends)
    return HFEngine(model, pad_id=pad).generate(prompts, 1, sampling).completions()


def evaluate_checkpoint(model_dir: Path, args, reference: list[list[int]] | None):
    """grpo.eval's greedy metrics, this model's first greedy completions, and the perplexity of the
    merged model's greedy completions under this model (`reference`; its own when None)."""
    import torch

    from grpo import data as grpo_data
    from grpo.eval.cli import evaluate_from_flags
    from grpo.model.load import default_device
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = evaluate_from_flags(eval_flags(model_dir, args))
    device = default_device()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # bf16 matmuls crawl on most CPUs
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    examples = grpo_data.load_examples(args.dataset, split="test", seed=3407)[:args.agreement_prompts]
    prompts = grpo_data.build_prompts(tokenizer, examples, 1024, grpo_data.SYSTEM_PROMPT).prompt_ids
    with torch.no_grad():
        completions = greedy_completions(model, tokenizer, prompts, args.max_completion_length)
        nll = count = 0.0
        for prompt, target in zip(prompts, reference if reference is not None else completions):
            ids = torch.tensor([prompt + target], device=device)
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()
            nll += torch.nn.functional.cross_entropy(logits, ids[0, len(prompt):], reduction="sum").item()
            count += len(target)
    result["perplexity_of_merged_greedy"] = math.exp(nll / max(count, 1))
    return result, completions


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of completions equal token for token."""
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


def main(argv=None) -> None:
    from grpo.model.packaged import PACKAGED_MODELS, convert_gguf

    args = parse_args(argv)
    out = Path(args.out)
    start = time.perf_counter()
    merged, ggufs = export_ggufs(args, out)
    print(f"exported in {time.perf_counter() - start:.0f} s", flush=True)
    if args.write_only:
        return
    end_tokens = PACKAGED_MODELS[args.model].end_tokens if args.model in PACKAGED_MODELS else ()
    reference, reference_completions = evaluate_checkpoint(merged, args, None)
    merged_bytes = sum(f.stat().st_size for f in merged.glob("*.safetensors"))
    results = {"merged": {**reference, "agreement": 1.0, "bytes": merged_bytes}}
    print(json.dumps({"type": "merged", **results["merged"]}), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))  # kept as it comes: a cut run keeps it
    for name, path in ggufs.items():
        checkpoint = out / f"checkpoint-{name}"
        if not checkpoint.is_dir():  # a rerun reuses what an earlier one converted
            convert_gguf(path, checkpoint, end_tokens)
        metrics, completions = evaluate_checkpoint(checkpoint, args, reference_completions)
        results[name] = {**metrics, "agreement": agreement(completions, reference_completions),
                         "bytes": path.stat().st_size}
        print(json.dumps({"type": name, **results[name]}), flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
