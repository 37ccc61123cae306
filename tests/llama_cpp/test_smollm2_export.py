"""Every GGUF type grpo writes, judged by llama.cpp: SmolLM2-135M-Instruct with a small LoRA change, merged
and exported by `python -m grpo.export`, loads in llama.cpp, tokenizes the chat prompt as transformers does,
and generates the merged model's greedy text (f16, bf16: the same text, but at near ties; the quantized types:
a measured agreement); its perplexity on fixed GSM8K text is within a measured bound of the merged model's;
and each quantized file is, block for block, the one llama-quantize writes from our f16 file.

The reference is the merged checkpoint (OUT/merged, bf16) run in float32 by transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo.export.gguf import GGUF_TYPES, gguf_file_name

N_NEW = 32  # greedy tokens per prompt
N_PROMPTS = 4
PPL_CTX = 256  # llama-perplexity's chunk: it scores the second half of each
PPL_ROWS = slice(100, 106)  # GSM8K test rows (question and worked answer) for the perplexity text

# Greedy text. f16 and bf16 hold the merged bf16 weights (bf16 -> f16 is exact but for subnormals): their text
# is the reference's, or parts from it only where the merged model's two likeliest tokens lie within NEAR_TIE
# logits (at this LoRA scale they never part; at 0.05, f16 and bf16 parted at gaps of 0.006 and 0.0009, where
# llama.cpp's arithmetic and float32 may break a tie differently). A quantized type moves every weight and one flipped near tie ends a greedy match:
# the bound is on the mean share of each prompt's tokens reproduced before the first difference, measured on 2
# cores (q8_0 0.81, q5_k_m 0.38, q4_k_m 0.37) less 0.25, a prompt's worth of room for ties another CPU breaks
# the other way. (q4_k_m parts at the first token of two prompts, where the merged model is sure by 1.5-2.2
# logits: there its rounding outweighs the merged weights' preference.)
NEAR_TIE = 0.02  # logits
GREEDY_AGREEMENT = {"f16": 1.0, "bf16": 1.0, "q8_0": 0.55, "q5_k_m": 0.12, "q4_k_m": 0.12}
# |ppl_llama.cpp / ppl_merged - 1|, measured: f16 +0.00002, bf16 -0.0010, q8_0 +0.0076, q5_k_m +0.058, q4_k_m
# +0.055. f16/bf16 differ from the float32 reference only in llama.cpp's arithmetic. A quantized type adds its
# weights' rounding (transformers on the same files' dequantized weights: +0.002, +0.053, +0.046; the files are
# llama-quantize's own, block for block: the test below) and llama.cpp's 8-bit activations in quantized matmuls
# (the other ~0.5%); the bounds leave about 1.5x room.
PPL_BOUND = {"f16": 0.002, "bf16": 0.002, "q8_0": 0.015, "q5_k_m": 0.08, "q4_k_m": 0.08}


def gsm8k_rows() -> list[dict]:
    from grpo import assets

    with open(assets.gsm8k_test_path()) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def merged(smollm2_export):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_export["merged"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def prompts(merged) -> list[tuple[str, list[int]]]:
    """(text, ids) of GSM8K questions through the chat template, as training builds its prompts."""
    from grpo.data import Example, build_prompts

    _, tokenizer = merged
    examples = [Example(row["question"], row["answer"]) for row in gsm8k_rows()[:N_PROMPTS]]
    built = build_prompts(tokenizer, examples, 1024)
    return list(zip(built.prompts, built.prompt_ids))


@torch.no_grad()
def greedy_ids(model, prompt_ids: list[int]) -> list[int]:
    """transformers' greedy continuation, cut after the first end-of-turn token (llama.cpp stops there)."""
    ends = model.generation_config.eos_token_id
    ends = {ends} if isinstance(ends, int) else set(ends)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=0,
                         eos_token_id=list(ends))
    new = out[0, len(prompt_ids):].tolist()
    return new[:next((i for i, t in enumerate(new) if t in ends), len(new))]


@pytest.fixture(scope="module")
def reference_greedy(merged, prompts) -> list[list[int]]:
    model, _ = merged
    completions = [greedy_ids(model, ids) for _, ids in prompts]
    assert all(completions), "a reference completion ended at once: choose other prompts"
    return completions


def matching_tokens(tokenizer, want: list[int], text: str) -> int:
    """How many of `want`'s first tokens llama.cpp's `text` reproduces: the largest k whose decoded
    prefix starts `text`."""
    k = 0
    while k < len(want) and text.startswith(tokenizer.decode(want[:k + 1], skip_special_tokens=True)):
        k += 1
    return k


@pytest.fixture(scope="module")
def ppl_text(tmp_path_factory) -> Path:
    rows = gsm8k_rows()[PPL_ROWS]
    path = tmp_path_factory.mktemp("ppl") / "gsm8k.txt"
    path.write_text("\n\n".join(f"{r['question']}\n{r['answer']}" for r in rows))
    return path


@torch.no_grad()
def perplexity(model, ids: list[int], n_ctx: int) -> float:
    """llama-perplexity's sum in transformers: whole chunks of n_ctx tokens, each evaluated from an
    empty cache, scoring the predictions of positions n_ctx/2 .. n_ctx-1."""
    first, nll, count = n_ctx // 2, 0.0, 0
    for start in range(0, len(ids) // n_ctx * n_ctx, n_ctx):
        chunk = torch.tensor([ids[start:start + n_ctx]])
        logp = model(chunk).logits[0].float().log_softmax(-1)  # (n_ctx, V)
        target = chunk[0, first + 1:]
        nll -= logp[first:-1].gather(-1, target[:, None]).sum().item()
        count += len(target)
    return math.exp(nll / count)


def text_ids(tokenizer, path: Path) -> list[int]:
    """The text's tokens as llama-perplexity takes them (the file's BOS rule, here none, is asserted)."""
    ids = tokenizer(path.read_text(), add_special_tokens=False).input_ids
    assert len(ids) >= 4 * PPL_CTX, "the perplexity text is too short for four chunks"
    return ids


@pytest.fixture(scope="module")
def reference_ppl(merged, ppl_text) -> float:
    model, tokenizer = merged
    return perplexity(model, text_ids(tokenizer, ppl_text), PPL_CTX)


def gguf_path(export: dict[str, Path], gguf_type: str) -> Path:
    return export[f"gguf-{gguf_type}"].parent / gguf_file_name(gguf_type)


def test_every_type_the_exporter_offers_has_a_bound_here():
    # a new --gguf type must be judged by llama.cpp here before it ships
    assert set(GREEDY_AGREEMENT) == set(PPL_BOUND) == set(GGUF_TYPES)


@torch.no_grad()
def top_two_gap(model, ids: list[int]) -> float:
    """The merged model's margin, in logits, between its two likeliest tokens after `ids`."""
    top = model(torch.tensor([ids])).logits[0, -1].float().topk(2).values
    return (top[0] - top[1]).item()


@pytest.mark.parametrize("gguf_type", list(GGUF_TYPES))
def test_llama_cpp_loads_each_type_tokenizes_the_chat_prompt_and_generates_the_merged_models_text(
        llama_cpp_tools, smollm2_export, merged, prompts, reference_greedy, gguf_type):
    model, tokenizer = merged
    path = gguf_path(smollm2_export, gguf_type)
    shares, gaps = [], []
    for (prompt, prompt_ids), want in zip(prompts, reference_greedy):
        got = llama_cpp_tools.complete(path, prompt, N_NEW)
        # the file's vocabulary, merges, pre-tokenizer and special tokens: llama.cpp's ids are ours, no BOS added
        assert got.prompt_ids == prompt_ids
        matched = matching_tokens(tokenizer, want, got.text)
        if matched == len(want):  # and nothing more: llama.cpp ended the turn where transformers did
            assert got.text == tokenizer.decode(want, skip_special_tokens=True)
        else:
            gaps.append(top_two_gap(model, prompt_ids + want[:matched]))
        shares.append(matched / len(want))
    agreement = sum(shares) / len(shares)
    print(f"{gguf_type}: greedy agreement {agreement:.3f} ({', '.join(f'{s:.2f}' for s in shares)}), "
          f"the merged model's top-two gap where they part: {', '.join(f'{g:.4f}' for g in gaps) or 'none'}")
    if GREEDY_AGREEMENT[gguf_type] == 1.0:
        assert all(gap < NEAR_TIE for gap in gaps), gaps
    else:
        assert agreement >= GREEDY_AGREEMENT[gguf_type], shares


@pytest.mark.parametrize("gguf_type", list(GGUF_TYPES))
def test_llama_cpp_perplexity_of_each_type_is_within_its_bound_of_the_merged_models(
        llama_cpp_tools, smollm2_export, reference_ppl, ppl_text, gguf_type):
    ppl = llama_cpp_tools.perplexity(gguf_path(smollm2_export, gguf_type), ppl_text, PPL_CTX)
    rel = ppl / reference_ppl - 1
    print(f"{gguf_type}: perplexity {ppl:.4f}, merged {reference_ppl:.4f}, {rel:+.4f}")
    assert abs(rel) <= PPL_BOUND[gguf_type], (ppl, reference_ppl)


@pytest.mark.parametrize("gguf_type", [t for t in GGUF_TYPES if t not in ("f16", "bf16")])
def test_each_quantized_file_is_the_one_llama_quantize_writes_from_our_f16(llama_cpp_tools, smollm2_export, tmp_path,
                                                                          gguf_type):
    # llama-quantize's own choice of every tensor's type and its own blocks, from the f16 file (which holds the
    # merged weights): measured identical in every block of every tensor, for each type
    from gguf import GGML_QUANT_SIZES, GGUFReader

    theirs = tmp_path / f"llama-quantize-{gguf_type}.gguf"
    llama_cpp_tools.run("llama-quantize", gguf_path(smollm2_export, "f16"), theirs, gguf_type.upper(),
                        llama_cpp_tools.threads)
    ours = {t.name: t for t in GGUFReader(gguf_path(smollm2_export, gguf_type)).tensors}
    want = {t.name: t for t in GGUFReader(theirs).tensors}
    assert {n: t.tensor_type.name for n, t in ours.items()} == {n: t.tensor_type.name for n, t in want.items()}
    same, blocks = 0, 0
    for name, tensor in ours.items():
        block_bytes = GGML_QUANT_SIZES[tensor.tensor_type][1]
        a = np.asarray(tensor.data).view(np.uint8).reshape(-1, block_bytes)
        b = np.asarray(want[name].data).view(np.uint8).reshape(-1, block_bytes)
        same += int((a == b).all(axis=1).sum())
        blocks += len(a)
    print(f"{gguf_type}: {same}/{blocks} blocks as llama-quantize writes them")
    assert same >= 0.999 * blocks


def test_the_lora_change_moves_the_greedy_text_and_the_perplexity_more_than_the_f16_bound(
        smollm2_dir, merged, prompts, reference_greedy, reference_ppl, ppl_text):
    # so an f16 file that dropped the adapter (the base's weights) would fail the tests above
    from transformers import AutoModelForCausalLM

    _, tokenizer = merged
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert [greedy_ids(base, ids) for _, ids in prompts] != reference_greedy
    base_ppl = perplexity(base, text_ids(tokenizer, ppl_text), PPL_CTX)
    print(f"base perplexity {base_ppl:.4f}, merged {reference_ppl:.4f}")
    assert abs(base_ppl / reference_ppl - 1) > 4 * PPL_BOUND["f16"], (base_ppl, reference_ppl)
