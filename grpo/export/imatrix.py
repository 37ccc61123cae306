"""Importance matrices for the k-quants: for each matrix of the model, the mean of the squared activation
that feeds each of its input columns, over some text (llama.cpp's imatrix). The k-quants weight their
error by it (grpo/export/kquants.py), so the columns that carry large activations keep their precision.

    importance = read_imatrix(Path("model.imatrix.gguf"))             # {GGUF tensor name: (cols,) float32}
    sums, counts = collect_imatrix(merged_model, token_ids, names)    # from our own forward passes
    write_imatrix(Path("imatrix.gguf"), sums, counts, "run prompts")  # as llama-imatrix writes it

The files are llama.cpp's: the GGUF that today's `llama-imatrix` writes (per matrix `NAME.in_sum2`, the
summed squares, ggml shape [cols, 1], and `NAME.counts`, the tokens summed, both F32; `general.type`
"imatrix", `imatrix.datasets`, `imatrix.chunk_count`, `imatrix.chunk_size`), and the legacy binary .dat
(int32 entry count; per entry int32 name length, name, int32 calls, int32 values, float32 values that
are already means times calls). The mean is taken as llama-quantize takes it (sums / count in float32).

`--gguf-imatrix auto` (`run_texts`): the run's own prompts (its dataset's training split under its
system prompt, from the run's config.json beside the adapter) with the merged model's greedy
completions of them, every token of both. Like `llama-imatrix` by default, the output layer gets none.

Not here: mixture-of-experts matrices (one importance per expert), the statistics `llama-imatrix` adds.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

IMATRIX_SUFFIXES = (".in_sum2", ".counts")


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------
def read_imatrix(path: Path) -> dict[str, np.ndarray]:
    """{GGUF tensor name: (cols,) float32 mean squared activation} of a llama.cpp imatrix file, GGUF or
    legacy .dat."""
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    try:
        return _read_gguf_imatrix(path) if magic == b"GGUF" else _read_legacy_imatrix(path)
    except (ValueError, struct.error, UnicodeDecodeError) as err:
        raise ValueError(f"--gguf-imatrix {path}: not a llama.cpp imatrix file ({err}); fix: pass the file "
                         "llama-imatrix wrote (.gguf or legacy .dat), or auto") from None


def _read_gguf_imatrix(path: Path) -> dict[str, np.ndarray]:
    reader = gguf.GGUFReader(path)
    tensors = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors}
    out = {}
    for name, sums in tensors.items():
        if not name.endswith(".in_sum2"):
            continue
        base = name.removesuffix(".in_sum2")
        counts = tensors.get(base + ".counts")
        if counts is None:
            raise ValueError(f"{base} has sums but no counts")
        sums = sums.reshape(counts.size, -1)  # one row per expert; a dense matrix has one
        if counts.size != 1:
            raise ValueError(f"{base} has {counts.size} experts; only dense matrices are quantized here")
        count = np.float32(np.round(counts.reshape(-1)[0]))  # llama.cpp: lround, then float
        out[base] = sums[0] / count if count > 0 else np.ones_like(sums[0])
    if not out:
        raise ValueError("no .in_sum2 tensors")
    return out


def _read_legacy_imatrix(path: Path) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    (n_entries,), off = struct.unpack_from("<i", data), 4
    if n_entries < 1:
        raise ValueError("no entries")
    out = {}
    for _ in range(n_entries):
        (length,) = struct.unpack_from("<i", data, off)
        name = data[off + 4:off + 4 + length].decode()
        calls, n_values = struct.unpack_from("<ii", data, off + 4 + length)
        off += 12 + length
        if n_values < 1 or off + 4 * n_values > len(data):
            raise ValueError(f"entry {name} is cut short")
        values = np.frombuffer(data, dtype="<f4", count=n_values, offset=off).astype(np.float32)
        off += 4 * n_values
        out[name] = values / np.float32(calls) if calls > 0 else values
    return out


def write_imatrix(path: Path, sums: dict[str, np.ndarray], counts: dict[str, int], dataset: str) -> Path:
    """Write summed squared activations `sums` over `counts` tokens per matrix as llama-imatrix's GGUF."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch="llama")  # gguf's writer states an arch; llama.cpp does not read it here
    writer.add_type("imatrix")
    writer.add_array("imatrix.datasets", [dataset])
    writer.add_uint32("imatrix.chunk_count", 1)
    writer.add_uint32("imatrix.chunk_size", max(counts.values(), default=0))
    for name in sorted(sums):
        writer.add_tensor(name + ".in_sum2", np.asarray(sums[name], dtype=np.float32).reshape(1, -1))
        writer.add_tensor(name + ".counts", np.array([[counts[name]]], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def check_imatrix(importance: dict[str, np.ndarray], columns: dict[str, int], source: str) -> None:
    """One line when `importance` is another model's: a name the model lacks, or a column count that is not
    the matrix's. `columns`: {GGUF name: input columns} of the matrices being quantized."""
    unknown = sorted(set(importance) - set(columns))
    if unknown:
        raise ValueError(f"--gguf-imatrix {source}: names {unknown[0]}, which this model does not have "
                         f"({len(unknown)} such); fix: pass the imatrix of this model, or auto")
    for name, values in importance.items():
        if values.shape != (columns[name],):
            raise ValueError(f"--gguf-imatrix {source}: {name} has {values.size} columns there, {columns[name]} "
                             "in this model; fix: pass the imatrix of this model, or auto")
    if not any(name in importance for name in columns):
        raise ValueError(f"--gguf-imatrix {source}: has no matrix of this model; fix: pass its imatrix, or auto")


# --------------------------------------------------------------------------------------------------
# Collecting it
# --------------------------------------------------------------------------------------------------
def collect_imatrix(model: nn.Module, sequences: list[list[int]],
                    names: gguf.TensorNameMap) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Summed squared inputs of every linear layer but the output layer, and the tokens summed, by GGUF
    name (`names`: the arch's map, grpo.export.gguf.tensor_name_map), over `sequences` (token ids, each
    run alone: no padding enters the sums)."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook_for(name: str):
        def hook(_module, inputs):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + (x * x).sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return hook

    handles = []
    for module_name, module in model.named_modules():
        target = names.get_name(module_name + ".weight", try_suffixes=(".weight",))
        if isinstance(module, nn.Linear) and target and target.startswith("blk."):
            handles.append(module.register_forward_pre_hook(hook_for(target)))
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for ids in sequences:
                model(input_ids=torch.tensor([ids], device=device))
    finally:
        for handle in handles:
            handle.remove()
    return {k: v.float().cpu().numpy() for k, v in sums.items()}, counts


def means(sums: dict[str, np.ndarray], counts: dict[str, int]) -> dict[str, np.ndarray]:
    """The mean squared activations, as llama-quantize divides what the file holds."""
    return {k: (v / np.float32(counts[k])).astype(np.float32) for k, v in sums.items()}


def run_settings(adapter_dir: Path) -> dict:
    """The config.json of the run the adapter comes from (beside it, or one folder up), or {}."""
    for path in (adapter_dir / "config.json", adapter_dir.parent / "config.json"):
        try:
            values = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(values, dict) and "system_prompt" in values:
            return values
    return {}


AUTO_PROMPTS = 32  # enough tokens (a few thousand) for a stable mean per column; each costs a greedy completion
AUTO_COMPLETION_TOKENS = 256


@torch.no_grad()
def run_texts(model: nn.Module, tokenizer, adapter_dir: Path) -> tuple[list[list[int]], str]:
    """Token ids of the run's own prompts and the model's greedy completions of them (see the module
    docstring), and a line that says what they are."""
    from grpo.answer_format import SYSTEM_PROMPT
    from grpo.data import chat_prompt, load_examples

    settings = run_settings(adapter_dir)
    dataset = settings.get("dataset") or "arithmetic"
    examples = load_examples(dataset, "train", seed=settings.get("seed", 0))[:AUTO_PROMPTS]
    system = settings.get("system_prompt") or SYSTEM_PROMPT
    budget = min(settings.get("max_completion_length") or AUTO_COMPLETION_TOKENS, AUTO_COMPLETION_TOKENS)
    prompts = [tokenizer(chat_prompt(tokenizer, example.question, system), add_special_tokens=False).input_ids
               for example in examples]
    sequences = greedy_sequences(model, prompts, budget, pad_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return sequences, f"{len(examples)} {dataset} training prompts and their greedy completions"


@torch.no_grad()
def greedy_sequences(model: nn.Module, prompts: list[list[int]], budget: int, pad_id: int) -> list[list[int]]:
    """Each prompt followed by the model's greedy completion (up to `budget` tokens, through its first end id),
    all prompts in one left-padded batch: one generation of `budget` steps rather than one per prompt."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=budget, do_sample=False, pad_token_id=pad_id)
    ends = model.generation_config.eos_token_id
    ends = set(ends if isinstance(ends, list) else [ends] if ends is not None else [])
    sequences = []
    for prompt, row in zip(prompts, out[:, width:].tolist()):
        stop = next((i + 1 for i, t in enumerate(row) if t in ends), len(row))
        sequences.append(prompt + row[:stop])
    return sequences
