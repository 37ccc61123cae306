"""`python -m grpo.eval --gguf` against llama.cpp's own server: the SmolLM2 export's f16 file, and the f16 base with
the LoRA GGUF on top (`--gguf-lora`), evaluated on a few arithmetic problems; every greedy completion llama.cpp
returns is our own engine's (transformers, float32) on the merged model, token for token, but where the merged model's
two likeliest tokens lie within NEAR_TIE logits (as test_smollm2_export judges the f16 text)."""

from __future__ import annotations

import json
import tempfile

import pytest
import torch
from test_smollm2_export import NEAR_TIE, top_two_gap

from grpo.eval import cli as eval_cli
from grpo.eval.llama_cpp import LlamaCppEngine
from grpo.rollout.hf import HFEngine

EVAL_FLAGS = ["--dataset", "arithmetic", "--eval-size", "4", "--samples", "0", "--max-completion-length", "24",
              "--seed", "0"]


def evaluate_gguf(monkeypatch, capsys, argv: list[str]) -> tuple[dict, list[tuple]]:
    """`python -m grpo.eval ARGV` in this process: its JSON result, and each (prompt ids, generations, sampling,
    rollout) that llama.cpp's engine produced in it."""
    calls = []

    class Recorded(LlamaCppEngine):
        def generate(self, prompt_ids, num_generations, sampling):
            rollout = super().generate(prompt_ids, num_generations, sampling)
            calls.append((prompt_ids, num_generations, sampling, rollout))
            return rollout

    monkeypatch.setattr(eval_cli, "LlamaCppEngine", Recorded)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the server's threads sleep, not spin, on a shared machine
    status = eval_cli.main(argv)
    out, err = capsys.readouterr()
    assert status == 0, err[-2000:]
    assert calls, "the evaluation never asked llama.cpp"
    return json.loads(out.strip().splitlines()[-1]), calls


def assert_greedy_is_ours(model, calls) -> int:
    """Every row llama.cpp generated is `model`'s own greedy completion through the HF engine (same prompts, same
    sampling and stop rule), or parts from it at a near tie of `model`; returns how many rows parted."""
    engine = HFEngine(model, pad_id=0)
    parted = []
    for prompt_ids, n, sampling, rollout in calls:
        assert sampling.temperature == 0  # --samples 0: the greedy pass only
        want_rows = engine.generate(prompt_ids, n, sampling).completions()
        for prompt, got, want in zip(prompt_ids, rollout.completions(), want_rows, strict=True):
            assert got, "llama.cpp returned an empty completion"
            if got == want:
                continue
            at = next(i for i, (a, b) in enumerate(zip(got + [None], want + [None])) if a != b)
            assert at < min(len(got), len(want)), (got, want)  # one ended where the other went on: no tie
            parted.append(top_two_gap(model, prompt + want[:at]))
    print(f"rows parting from ours at the merged model's top-two gaps: {parted or 'none'}")
    assert all(gap < NEAR_TIE for gap in parted), parted
    return len(parted)


@pytest.fixture(scope="module")
def merged_fp32(smollm2_export):
    """The exported merged checkpoint (bf16) in float32: the f16 file holds exactly its weights."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_export["merged"], dtype=torch.float32).eval()


def test_eval_gguf_of_the_f16_export_gives_our_merged_models_greedy_completions(
        llama_cpp_tools, smollm2_export, merged_fp32, monkeypatch, capsys, tmp_path):
    per_problem = tmp_path / "problems.jsonl"
    result, calls = evaluate_gguf(monkeypatch, capsys, [
        "--model", str(smollm2_export["merged"]), "--gguf", str(smollm2_export["gguf-f16"]),
        "--llama-cpp", str(llama_cpp_tools.bin), "--per-problem", str(per_problem), *EVAL_FLAGS])
    assert result["eval/prompts"] == 4 and 0 <= result["eval/greedy_accuracy"] <= 1
    assert len(per_problem.read_text().splitlines()) == 4
    assert sum(len(c[0]) for c in calls) == 4
    assert_greedy_is_ours(merged_fp32, calls)


def test_eval_gguf_of_the_base_with_the_lora_gguf_gives_the_merged_models_greedy_completions(
        llama_cpp_tools, smollm2_dir, smollm2_export, smollm2_base_f16, monkeypatch, capsys):
    # the reference: base + adapter merged in float32 (llama.cpp adds the adapter's product to the f16 base's,
    # with no rounding of the sum to 16 bits as the exported merged checkpoint has)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def base():
        return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()

    merged = PeftModel.from_pretrained(base(), smollm2_export["adapter"]).merge_and_unload().eval()
    _, calls = evaluate_gguf(monkeypatch, capsys, [
        "--model", str(smollm2_dir), "--gguf", str(smollm2_base_f16), "--gguf-lora", str(smollm2_export["gguf-lora"]),
        "--llama-cpp", str(llama_cpp_tools.bin), *EVAL_FLAGS])
    assert_greedy_is_ours(merged, calls)
    # and the adapter changes these completions: a server that dropped it would have failed above
    plain = HFEngine(base(), pad_id=0)
    assert any(plain.generate(p, n, s).completions() != r.completions() for p, n, s, r in calls)


def test_a_file_llama_cpp_cannot_load_is_one_line_naming_its_error(llama_cpp_tools, smollm2_dir, tmp_path, capsys,
                                                                   monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the server's log, kept for the error, goes here
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file" * 100)
    status = eval_cli.main(["--model", str(smollm2_dir), "--gguf", str(junk), "--llama-cpp", str(llama_cpp_tools.bin),
                            *EVAL_FLAGS])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 1 and len(lines) == 1, lines
    assert "llama-server exited" in lines[0] and str(junk) in lines[0] and "invalid magic" in lines[0], lines[0]
    assert str(tmp_path / "llama-server-") in lines[0]  # and names its log
