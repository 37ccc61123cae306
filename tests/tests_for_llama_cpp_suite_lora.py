"""llama.cpp itself as the judge of the LoRA GGUF and the importance-weighted k-quants (for `./dev test-gguf`):

- SmolLM2's f16 base GGUF + our adapter GGUF (`llama-completion --lora`) gives the same greedy text as
  our merged model's f16 GGUF, and not the base's;
- `llama-quantize --imatrix` on our imatrix file writes the k-quant blocks our weighted quantizer writes.

Slow (a SmolLM2 export and several llama.cpp runs): needs the llama.cpp tools built into the cache
(~/.cache/grpo/llama.cpp-*/build/bin, or $GRPO_LLAMA_CPP_BIN) and the packaged SmolLM2; skipped without.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.xdist_group("smollm2")
PROMPTS = ["The capital of France is", "Q: What is 12 + 30?\nA:", "Once upon a time, a small robot"]


@pytest.fixture(scope="module")
def llama_bin() -> Path:
    """The folder holding llama-completion and llama-quantize."""
    roots = [Path(os.environ["GRPO_LLAMA_CPP_BIN"])] if os.environ.get("GRPO_LLAMA_CPP_BIN") else []
    roots += sorted((Path.home() / ".cache" / "grpo").glob("llama.cpp-*/build/bin"))
    roots += sorted((Path.home() / ".cache" / "grpo").glob("llama.cpp-*/bin"))
    for root in roots:
        if all((root / tool).is_file() for tool in ("llama-completion", "llama-quantize")):
            return root
    pytest.skip("llama.cpp tools not built (llama-completion, llama-quantize in ~/.cache/grpo/llama.cpp-*/)")


@pytest.fixture(scope="module")
def smollm2_export(tmp_path_factory):
    """SmolLM2 with a trained-looking adapter (non-zero B), exported as fp16 merged + f16 GGUF, q4_k_m with
    an auto imatrix, the LoRA GGUF; and the base as an f16 GGUF."""
    from test_export import load_dense, trained_adapter

    from grpo.export import imatrix
    from grpo.export.gguf import write_gguf
    from grpo.export.merge import export
    from grpo.model.packaged import packaged_model_dir

    try:
        base_dir = packaged_model_dir("smollm2-135m-instruct")
    except (ValueError, FileNotFoundError) as err:
        pytest.skip(f"SmolLM2 package unavailable: {err}")
    root = tmp_path_factory.mktemp("smollm2-lora")
    run = root / "run"
    trained_adapter(load_dense(base_dir), run / "adapter", seed=5, rank=8)
    (run / "config.json").write_text(json.dumps({"dataset": "arithmetic", "system_prompt": "Answer briefly."}))
    with pytest.MonkeyPatch.context() as patch:  # a few hundred tokens: enough to weight by, quick on a CPU
        patch.setattr(imatrix, "AUTO_PROMPTS", 4)
        patch.setattr(imatrix, "AUTO_COMPLETION_TOKENS", 48)
        paths = export(str(base_dir), run, root / "out", dtype="fp16", gguf="f16,q4_k_m", gguf_lora=True,
                       gguf_imatrix="auto")
    paths["base-f16"] = write_gguf(base_dir, root / "base" / "base-f16.gguf", "f16")
    return paths


def greedy(llama_bin: Path, model: Path, prompt: str, lora: Path | None = None, n: int = 24) -> str:
    cmd = [str(llama_bin / "llama-completion"), "-m", str(model), "-p", prompt, "-n", str(n), "--temp", "0",
           "--top-k", "1", "--seed", "1", "-no-cnv", "--no-display-prompt", "-t", "2", "-c", "256", "--no-warmup"]
    if lora is not None:
        cmd += ["--lora", str(lora)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_base_gguf_with_our_lora_gives_the_merged_models_greedy_text(llama_bin, smollm2_export):
    merged, base, lora = smollm2_export["gguf-f16"], smollm2_export["base-f16"], smollm2_export["gguf-lora"]
    differs = 0
    for prompt in PROMPTS:
        want = greedy(llama_bin, merged, prompt)
        assert greedy(llama_bin, base, prompt, lora=lora) == want, prompt
        differs += greedy(llama_bin, base, prompt) != want
    assert differs >= 1  # the adapter changes the text: llama.cpp applied it, it was not silently dropped


def gguf_blocks(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    return {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in gguf.GGUFReader(path).tensors}


def test_llama_quantize_with_our_imatrix_writes_our_weighted_blocks(llama_bin, smollm2_export, tmp_path):
    from grpo.export.kquants import BLOCK_BYTES

    source = smollm2_export["gguf-f16"]  # fp16 merged weights: the same float32 values reach both quantizers
    theirs_path = tmp_path / "theirs-q4_k_m.gguf"
    run = subprocess.run([str(llama_bin / "llama-quantize"), "--imatrix", str(smollm2_export["gguf-imatrix"]),
                          str(source), str(theirs_path), "Q4_K_M", "2"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    plain_path = tmp_path / "plain-q4_k_m.gguf"
    run = subprocess.run([str(llama_bin / "llama-quantize"), str(source), str(plain_path), "Q4_K_M", "2"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    ours, theirs, plain = (gguf_blocks(p) for p in (smollm2_export["gguf-q4_k_m"], theirs_path, plain_path))
    weighted: set[str] = set()  # names our imatrix covers, with a k-quant type on both sides
    from grpo.export.imatrix import read_imatrix

    covered = read_imatrix(smollm2_export["gguf-imatrix"])
    compared, same_blocks, all_blocks, changed_by_imatrix = 0, 0, 0, 0
    for name, (qtype, data) in ours.items():
        if qtype not in BLOCK_BYTES or name not in covered or theirs.get(name, ("",))[0] != qtype:
            continue
        weighted.add(name)
        block = BLOCK_BYTES[qtype]
        a, b = data.reshape(-1, block), theirs[name][1].reshape(-1, block)
        same_blocks += int(np.all(a == b, axis=1).sum())
        all_blocks += a.shape[0]
        changed_by_imatrix += not np.array_equal(b, plain[name][1])
        compared += 1
    assert compared >= 30, sorted(weighted)  # SmolLM2's ffn_down rows are 1536 wide: whole 256-blocks
    assert changed_by_imatrix == compared  # llama-quantize used the imatrix on every one
    # llama.cpp built with -march=native may fuse a multiply-add where numpy rounds twice: a rare block differs
    assert same_blocks / all_blocks > 0.99, (same_blocks, all_blocks)
