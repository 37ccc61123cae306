"""llama.cpp itself as the judge of the LoRA GGUF and the importance-weighted k-quants:

- SmolLM2's f16 base GGUF + our adapter GGUF (`llama-completion --lora`) gives the same greedy text as
  our merged model's f16 GGUF, and not the base's;
- `llama-quantize --imatrix` on our imatrix file writes the k-quant blocks our weighted quantizer writes.

The model is the suite's `smollm2_export` (SmolLM2 + a random LoRA)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

PROMPTS = ["The capital of France is", "Q: What is 12 + 30?\nA:", "Once upon a time, a small robot"]
N_NEW = 24


@pytest.fixture(scope="module")
def imatrix_export(smollm2_export, tmp_path_factory) -> dict[str, Path]:
    """The same adapter exported as q4_k_m weighted by `--gguf-imatrix auto` (from a run's config.json beside
    it), with its imatrix file: {"gguf-q4_k_m", "gguf-imatrix", ...}."""
    from grpo.export import imatrix
    from grpo.export.merge import export

    run = tmp_path_factory.mktemp("smollm2-imatrix") / "run"
    shutil.copytree(smollm2_export["adapter"], run / "adapter")
    (run / "config.json").write_text(json.dumps({"dataset": "arithmetic", "system_prompt": "Answer briefly."}))
    with pytest.MonkeyPatch.context() as patch:  # a few hundred tokens: enough to weight by, quick on a CPU
        patch.setattr(imatrix, "AUTO_PROMPTS", 4)
        patch.setattr(imatrix, "AUTO_COMPLETION_TOKENS", 48)
        return export("smollm2-135m-instruct", run / "adapter", run.parent / "out", gguf="q4_k_m",
                      gguf_imatrix="auto")


def test_base_gguf_with_our_lora_gives_the_merged_models_greedy_text(llama_cpp_tools, smollm2_export,
                                                                     smollm2_base_f16):
    merged, lora = smollm2_export["gguf-f16"], smollm2_export["gguf-lora"]
    differs = 0
    for prompt in PROMPTS:
        want = llama_cpp_tools.complete(merged, prompt, N_NEW).text
        assert llama_cpp_tools.complete(smollm2_base_f16, prompt, N_NEW, "--lora", lora).text == want, prompt
        differs += llama_cpp_tools.complete(smollm2_base_f16, prompt, N_NEW).text != want
    assert differs >= 1  # the adapter changes the text: llama.cpp applied it, it was not silently dropped


def gguf_blocks(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    return {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in GGUFReader(path).tensors}


def test_llama_quantize_with_our_imatrix_writes_our_weighted_blocks(llama_cpp_tools, smollm2_export,
                                                                    imatrix_export, tmp_path):
    from grpo.export.imatrix import read_imatrix
    from grpo.export.kquants import BLOCK_BYTES

    # the session's f16 file holds the same merged weights (the same adapter on the same base, rounded to bf16)
    source, ours_path = smollm2_export["gguf-f16"], imatrix_export["gguf-q4_k_m"]
    theirs_path, plain_path = tmp_path / "theirs-q4_k_m.gguf", tmp_path / "plain-q4_k_m.gguf"
    llama_cpp_tools.run("llama-quantize", "--imatrix", imatrix_export["gguf-imatrix"], source, theirs_path, "Q4_K_M",
                        llama_cpp_tools.threads)
    llama_cpp_tools.run("llama-quantize", source, plain_path, "Q4_K_M", llama_cpp_tools.threads)
    ours, theirs, plain = (gguf_blocks(p) for p in (ours_path, theirs_path, plain_path))
    covered = read_imatrix(imatrix_export["gguf-imatrix"])
    compared, same_blocks, all_blocks, changed_by_imatrix = 0, 0, 0, 0
    for name, (qtype, data) in ours.items():
        if qtype not in BLOCK_BYTES or name not in covered or theirs.get(name, ("",))[0] != qtype:
            continue
        block = BLOCK_BYTES[qtype]
        a, b = data.reshape(-1, block), theirs[name][1].reshape(-1, block)
        same_blocks += int(np.all(a == b, axis=1).sum())
        all_blocks += a.shape[0]
        changed_by_imatrix += not np.array_equal(b, plain[name][1])
        compared += 1
    print(f"{compared} weighted tensors, {same_blocks}/{all_blocks} blocks as llama-quantize --imatrix writes them")
    assert compared >= 30  # SmolLM2's ffn_down rows are 1536 wide: whole 256-blocks
    assert changed_by_imatrix == compared  # llama-quantize used the imatrix on every one
    # llama.cpp built with -march=native may fuse a multiply-add where numpy rounds twice: a rare block differs
    assert same_blocks / all_blocks > 0.99, (same_blocks, all_blocks)
