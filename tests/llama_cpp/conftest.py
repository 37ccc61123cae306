"""llama.cpp as the judge of the GGUF files grpo writes: its own tools, built from source by
scripts/llama-cpp.sh, run on our exports (`./dev test-gguf`; not part of `./dev test`).

    def test_x(llama_cpp_tools):                     # a LlamaCpp: the folder of the built tools
        text = llama_cpp_tools.complete(model, prompt, n_predict=32).text
        ppl = llama_cpp_tools.perplexity(model, text_file, n_ctx=256)
        llama_cpp_tools.run("llama-quantize", src, dst, "Q4_K_M")   # any tool, any flags

The tools' folder comes from GRPO_LLAMA_CPP_BIN (./dev test-gguf sets it), else the build's default
folder. A missing build fails every test here (never a skip): this suite exists to run llama.cpp.
Also `smollm2_export`: the packaged SmolLM2 with a small LoRA change merged and exported in every
GGUF type and as a LoRA GGUF, once per session; `smollm2_base_f16`: the packaged SmolLM2 as an f16 GGUF.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

TOOLS = ("llama-completion", "llama-perplexity", "llama-quantize", "llama-imatrix", "llama-server")
# llama-completion --verbose-prompt lists the prompt's tokens as `   id -> 'piece'` (after the log's time and level)
_PROMPT_TOKEN = re.compile(r"^(?:[\d.]+ I )?\s*(\d+) -> '", re.MULTILINE)
_FINAL_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+)")


@dataclass(frozen=True)
class Completion:
    text: str  # what llama.cpp generated (the prompt not echoed)
    prompt_ids: list[int]  # the prompt as llama.cpp tokenized it


@dataclass(frozen=True)
class LlamaCpp:
    """The built llama.cpp tools in `bin`, and the ways the suite runs them."""

    bin: Path
    # half the cores, up to 4: the model is small, and the machine may be shared
    threads: int = max(1, min((os.cpu_count() or 2) // 2, 4))

    def tool(self, name: str) -> Path:
        return self.bin / name

    def run(self, name: str, *args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess:
        """Run tool `name` with `args`; a non-zero exit fails the test with the end of what it printed."""
        cmd = [str(self.tool(name)), *map(str, args)]
        # OpenMP threads that spin while waiting slow to a crawl on a shared machine; passive ones sleep
        env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, errors="replace", env=env)
        if done.returncode != 0:
            pytest.fail(f"{name} exited {done.returncode}: {' '.join(cmd)}\n{done.stderr[-3000:]}\n{done.stdout[-1000:]}")
        return done

    def complete(self, model: Path, prompt: str, n_predict: int, *extra: str | Path) -> Completion:
        """Greedy text after `prompt` (raw text, its special tokens parsed; no chat template applied on top,
        no BOS unless the file asks for one), at most `n_predict` tokens, stopping at an end-of-turn token."""
        with tempfile.TemporaryDirectory() as tmp:  # -f keeps the text as it is (no quoting, no trailing newline)
            prompt_file = Path(tmp) / "prompt.txt"
            prompt_file.write_text(prompt)
            done = self.run("llama-completion", "-m", model, "-f", prompt_file, "-n", n_predict, "-no-cnv",
                            "--temp", "0", "--top-k", "1", "--repeat-penalty", "1", "--seed", "0",
                            "--no-display-prompt", "--verbose-prompt", "-c", "2048", "-t", self.threads,
                            "--no-warmup", "--log-colors", "off", *map(str, extra))
        # stdout: the text, then " [end of text]" where an end-of-turn token stopped it, then a blank line
        text, ended, _ = done.stdout.partition(" [end of text]")
        text = text if ended else text.removesuffix("\n\n")
        return Completion(text=text, prompt_ids=[int(i) for i in _PROMPT_TOKEN.findall(done.stderr)])

    def perplexity(self, model: Path, text_file: Path, n_ctx: int, *extra: str | Path) -> float:
        """llama-perplexity's final estimate over `text_file` in chunks of `n_ctx` tokens (each chunk
        scores its second half; test_smollm2_export.perplexity is the same sum in transformers)."""
        done = self.run("llama-perplexity", "-m", model, "-f", text_file, "-c", n_ctx, "-b", n_ctx,
                        "-t", self.threads, "--log-colors", "off", *map(str, extra))
        found = _FINAL_PPL.search(done.stdout + done.stderr)
        if found is None:
            pytest.fail(f"llama-perplexity printed no final estimate:\n{done.stderr[-2000:]}")
        return float(found.group(1))


def tools_folder() -> Path:
    """Where the tools are: GRPO_LLAMA_CPP_BIN, else the folder scripts/llama-cpp.sh builds into."""
    from grpo.eval.llama_cpp import default_bin_dir

    return default_bin_dir()


@pytest.fixture(scope="session")
def llama_cpp_tools() -> LlamaCpp:
    folder = tools_folder()
    missing = [t for t in TOOLS if not os.access(folder / t, os.X_OK)]
    if missing:
        pytest.fail(f"llama.cpp's {', '.join(missing)} not built in {folder}; fix: run ./dev test-gguf (it builds "
                    "them once with scripts/llama-cpp.sh), or set GRPO_LLAMA_CPP_BIN to a folder holding them")
    return LlamaCpp(folder)


# --------------------------------------------------------------------------------------------------
# The exported model: SmolLM2 with a small LoRA change, every GGUF type
# --------------------------------------------------------------------------------------------------
# std of the random lora_B: the fixed text's perplexity goes from 4.31 (base) to 4.65 and some greedy texts change
LORA_SCALE = 0.04


def random_adapter(model_dir: Path, folder: Path, scale: float = LORA_SCALE, seed: int = 0) -> Path:
    """An rsLoRA adapter (r=8, alpha=16, every target) whose B is random, not zero: a stand-in for a
    trained one, saved in PEFT format as training saves it."""
    from transformers import AutoModelForCausalLM

    from grpo.config import Config
    from grpo.model.load import add_lora

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):  # peft draws A from the global generator: the same A every session
        torch.manual_seed(seed)
        policy = add_lora(base, Config(model="unused", lora_rank=8, lora_alpha=16, gradient_checkpointing=False))
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape) * scale)
    policy.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from grpo.model.packaged import packaged_model_dir

    return packaged_model_dir("smollm2-135m-instruct")  # offline from its PyPI package; an error here fails


@pytest.fixture(scope="session")
def smollm2_export(smollm2_dir, tmp_path_factory) -> dict[str, Path]:
    """`python -m grpo.export` of SmolLM2 + a random LoRA in every GGUF type and as a LoRA GGUF: {"adapter",
    "merged", "gguf-f16", "gguf-q8_0", ..., "gguf-lora"} -> path (the merged model in bf16, as the export's
    default)."""
    from grpo.export.gguf import GGUF_TYPES
    from grpo.export.merge import export

    tmp = tmp_path_factory.mktemp("smollm2-export")
    random_adapter(smollm2_dir, tmp / "adapter")
    return export("smollm2-135m-instruct", tmp / "adapter", tmp / "out", gguf=",".join(GGUF_TYPES), gguf_lora=True)


@pytest.fixture(scope="session")
def smollm2_base_f16(smollm2_dir, tmp_path_factory) -> Path:
    """The packaged SmolLM2 itself (no adapter) as an f16 GGUF: the base a LoRA GGUF is applied to."""
    from grpo.export.gguf import write_gguf

    return write_gguf(smollm2_dir, tmp_path_factory.mktemp("smollm2-base") / "base-f16.gguf", "f16")
