"""A merged checkpoint written as GGUF files, as llama.cpp's converter and quantizer would write them.

    write_gguf(Path("exports/run/merged"), Path("exports/run/gguf-q4_k_m/model-q4_k_m.gguf"), "q4_k_m")

One file per type in `GGUF_TYPES`: f16, bf16, q8_0 (every matrix in that type), and the mixes q5_k_m and
q4_k_m, which choose per tensor as llama.cpp's `llama-quantize` does for Q5_K_M / Q4_K_M without an
importance matrix: Q6_K for the output layer (the token embeddings when they are tied to it), Q6_K for
attn_v and ffn_down in the layers where `_more_bits` holds (the first and last eighth, and every third
between), Q4_K / Q5_K elsewhere; a tensor whose rows are not a whole number of 256-blocks falls back
to Q5_0 / Q5_1 / Q8_0 (Q8_0 for the output layer) as llama.cpp does. Vectors (norms, biases) are F32.

What the file holds, as llama.cpp's convert_hf_to_gguf.py writes it for the same model (Llama, SmolLM2:
arch `llama`; Qwen2: arch `qwen2`):
- tensor names from gguf's own `TensorNameMap` (`blk.N.attn_q.weight`, `token_embd.weight`, ...); for
  arch `llama` the q and k rows are reordered (`llama_rope_order`): llama.cpp's rotary embedding pairs
  neighbouring dimensions where the Hugging Face layout pairs halves. Readers (transformers too) undo it.
- `{arch}.context_length, embedding_length, block_count, feed_forward_length, attention.head_count(_kv),
  rope.freq_base, attention.layer_norm_rms_epsilon` (+ `vocab_size`, `rope.dimension_count` for llama),
  and `rope_freqs.weight` for Llama 3's rope scaling;
- the tokenizer: byte-level BPE (`tokenizer.ggml.model` gpt2) with its tokens, token types, merges,
  pre-tokenizer name, bos/eos/padding ids, chat template (gguf's `SpecialVocab`), and the turn's other
  end token from generation_config.json as `eot_token_id`.

With an importance matrix (`importance`, grpo/export/imatrix.py) the Q4_K/Q5_K/Q6_K tensors it names are
quantized with it, as `llama-quantize --imatrix` does; the types chosen stay the same, and the fallback
types (Q5_0, Q5_1, Q8_0) are written without it (llama.cpp would weight Q5_0/Q5_1 too).

Not here: merging (grpo/export/merge.py), the k-quant arithmetic (grpo/export/kquants.py), sentencepiece or other
non-BPE tokenizers, architectures other than those in `ARCHITECTURES`.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from grpo.export.imatrix import check_imatrix
from grpo.export.kquants import BLOCK_BYTES, quantize_k


@dataclass(frozen=True)
class GgufType:
    """One `--gguf` choice: the file type the GGUF header states and the tensor type most matrices get."""

    name: str
    file_type: str  # gguf.LlamaFileType member
    default: str  # gguf.GGMLQuantizationType member
    mix: bool = False  # True: types chosen per tensor as llama-quantize's _M mixes


GGUF_TYPES: dict[str, GgufType] = {t.name: t for t in (
    GgufType("f16", "MOSTLY_F16", "F16"),
    GgufType("bf16", "MOSTLY_BF16", "BF16"),
    GgufType("q8_0", "MOSTLY_Q8_0", "Q8_0"),
    GgufType("q5_k_m", "MOSTLY_Q5_K_M", "Q5_K", mix=True),
    GgufType("q4_k_m", "MOSTLY_Q4_K_M", "Q4_K", mix=True),
)}
ARCHITECTURES = {"llama": "LLAMA", "qwen2": "QWEN2"}  # config.model_type -> gguf.MODEL_ARCH member
# llama.cpp's names for the pre-tokenizers of the BPE tokenizers we train, by the tokenizer.json that has them
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # rows not a whole number of 256-blocks


def parse_gguf_types(text: str) -> tuple[str, ...]:
    """`--gguf f16,q4_k_m` -> ("f16", "q4_k_m"); an unknown name is one line naming the choices."""
    names = tuple(dict.fromkeys(n.strip().lower() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in GGUF_TYPES]
    if unknown or not names:
        raise ValueError(f"--gguf {text}: {'unknown type ' + unknown[0] if unknown else 'no type named'}; "
                         f"fix: choose from {', '.join(GGUF_TYPES)} (comma-separated)")
    return names


def gguf_file_name(gguf_type: str) -> str:
    return f"model-{gguf_type}.gguf"


def check_convertible(config, tokenizer) -> None:
    """Refuse, in one line and before anything is written, a model these files cannot describe."""
    check_arch(config)
    rope = _rope(config)
    if rope.get("rope_type", "default") not in ("default", "linear", "llama3"):
        raise ValueError(f"--gguf: rope scaling {rope.get('rope_type')!r} is not written; fix: export without --gguf")
    bpe_pre_tokenizer(tokenizer)


def check_arch(config, flag: str = "--gguf") -> None:
    """One line for a model whose architecture has no GGUF layout here."""
    arch = getattr(config, "model_type", None)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{flag}: cannot write a {arch!r} model as GGUF; fix: export without {flag} (the merged "
                         f"checkpoint is written) or use a {' or '.join(ARCHITECTURES)} model")


def bpe_pre_tokenizer(tokenizer) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a (fast) tokenizer of Llama 3, Qwen2, SmolLM2 or GPT-2."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    is_bpe = backend is not None and type(backend.model).__name__ == "BPE"
    pre = json.loads(backend.pre_tokenizer.__getstate__()) if is_bpe and backend.pre_tokenizer is not None else {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    splits = [s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    digits = any(s.get("type") == "Digits" and s.get("individual_digits") for s in steps)
    if is_bpe and byte_level:
        if splits == [LLAMA3_SPLIT] and not digits:
            return "llama-bpe"
        if splits == [QWEN2_SPLIT] and not digits:
            return "qwen2"
        if not splits and byte_level[0].get("use_regex", True):
            return "smollm" if digits else "gpt-2"
    raise ValueError(f"--gguf: the tokenizer ({type(tokenizer).__name__}) is not a byte-level BPE tokenizer of Llama 3, "
                     "Qwen2, SmolLM2 or GPT-2 (those whose llama.cpp pre-tokenizer is known here); fix: export "
                     "without --gguf")


# --------------------------------------------------------------------------------------------------
# Which type each tensor gets
# --------------------------------------------------------------------------------------------------
def _more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third in between."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], gguf_type: str, n_layer: int, tied: bool) -> str:
    """The ggml type (a GGMLQuantizationType name) tensor `name` (a GGUF name, numpy `shape`) gets."""
    choice = GGUF_TYPES[gguf_type]
    if len(shape) < 2 or not name.endswith(".weight") or name.endswith("_norm.weight"):
        return "F32"
    cols = shape[-1]
    if not choice.mix:
        return "F16" if choice.default == "Q8_0" and cols % 32 else choice.default  # as the converter falls back
    qtype = choice.default
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        qtype = "Q8_0" if cols % 256 else "Q6_K"
    elif name.endswith((".attn_v.weight", ".ffn_down.weight")) and _more_bits(layer, n_layer):
        qtype = "Q6_K"
    if qtype in _FALLBACK and cols % 256:
        qtype = _FALLBACK[qtype]
    return "F16" if cols % 32 else qtype


def encode(data: np.ndarray, qtype: str, pool: ProcessPoolExecutor | None = None,
           importance: np.ndarray | None = None) -> np.ndarray:
    """float32 `data` in ggml type `qtype`: F32/F16 arrays, or the raw bytes of a block type (the
    k-quants on `pool`'s workers when there is one, weighted by `importance` when given)."""
    if qtype == "F32":
        return data.astype(np.float32)
    if qtype in BLOCK_BYTES:
        return quantize_k(data, gguf.GGMLQuantizationType[qtype], pool, importance)
    return gguf.quants.quantize(data, gguf.GGMLQuantizationType[qtype])


# --------------------------------------------------------------------------------------------------
# The tensors, renamed and reordered as llama.cpp's converter does
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlannedTensor:
    name: str  # GGUF name
    source: str  # safetensors name, or "" for a tensor computed here
    shape: tuple[int, ...]  # numpy order (rows, cols)
    qtype: str


def _rope(config) -> dict:
    """The rope settings whatever transformers version wrote the config (rope_parameters / rope_scaling)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    rope.update({k: v for k, v in scaling.items() if k not in rope})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope["type"]
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _llama_rope_freqs(config) -> np.ndarray | None:
    """Llama 3's per-frequency rope factors (`rope_freqs.weight`), or None without llama3 rope scaling."""
    rope = _rope(config)
    if rope.get("rope_type") != "llama3":
        return None
    dim, factor = _head_dim(config), rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_len = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / dim)
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def llama_rope_order(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q or k projection from the Hugging Face rotary layout (each head's halves rotate
    together) to llama.cpp's (neighbouring pairs rotate together)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors to convert")
    return files


def tensor_name_map(config) -> gguf.TensorNameMap:
    """gguf's map from Hugging Face tensor names to llama.cpp's for the model of `config`."""
    return gguf.get_tensor_name_map(gguf.MODEL_ARCH[ARCHITECTURES[config.model_type]], config.num_hidden_layers)


def plan_tensors(model_dir: Path, config, gguf_type: str) -> list[PlannedTensor]:
    """Every tensor of the file, in llama.cpp's order (rope factors, embeddings, layers, output), typed."""
    names = tensor_name_map(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    found: list[tuple[str, str, tuple[int, ...]]] = []
    for file in _safetensors_files(model_dir):
        with safe_open(file, framework="np") as f:
            for key in f.keys():
                if key.endswith("rotary_emb.inv_freq") or (tied and key == "lm_head.weight"):
                    continue  # recomputed by every reader; a tied head is the embedding
                name = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise ValueError(f"{file}: tensor {key} has no GGUF name for arch {config.model_type}; fix: "
                                     "export without --gguf")
                found.append((name, key, tuple(f.get_slice(key).get_shape())))

    def order(item):
        name = item[0]
        if name.startswith("blk."):
            return int(name.split(".")[1]), False, name
        return (-1 if name.startswith("token_embd") else 1 << 30), name.startswith("output."), name

    plan = [PlannedTensor(name, key, shape, tensor_type(name, shape, gguf_type, config.num_hidden_layers, tied))
            for name, key, shape in sorted(found, key=order)]
    freqs = _llama_rope_freqs(config) if config.model_type == "llama" else None
    if freqs is not None:
        plan.insert(0, PlannedTensor("rope_freqs.weight", "", freqs.shape, "F32"))
    return plan


def _tensor_data(model_dir: Path, config, item: PlannedTensor) -> np.ndarray:
    """The float32 values of one planned tensor, reordered for llama.cpp's rotary layout where needed."""
    if not item.source:
        return _llama_rope_freqs(config)
    for file in _safetensors_files(model_dir):
        with safe_open(file, framework="pt") as f:
            if item.source in f.keys():
                data = f.get_tensor(item.source).to(torch.float32).numpy()
                break
    if config.model_type == "llama" and ".attn_q." in item.name:
        data = llama_rope_order(data, config.num_attention_heads)
    elif config.model_type == "llama" and ".attn_k." in item.name:
        data = llama_rope_order(data, getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    return data


# --------------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------------
def _add_model_metadata(writer, config, model_dir: Path, gguf_type: str, name: str) -> None:
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    rope = _rope(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    if "head_dim" in raw:  # as the converter: only when the checkpoint states it
        writer.add_key_length(raw["head_dim"])
        writer.add_value_length(raw["head_dim"])
    writer.add_file_type(gguf.LlamaFileType[GGUF_TYPES[gguf_type].file_type])
    if config.model_type == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(_head_dim(config))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))


def _add_tokenizer_metadata(writer, config, model_dir: Path, tokenizer) -> None:
    """Tokens by id (padded to the model's vocabulary with unused [PADn]), their types, the BPE merges,
    the special ids and the chat template, as the converter's gpt2 vocabulary."""
    by_id = {i: tok for tok, i in tokenizer.get_vocab().items() if i < config.vocab_size}
    added = {i: t for i, t in tokenizer.added_tokens_decoder.items()}
    tokens, types = [], []
    for i in range(config.vocab_size):
        if i not in by_id or by_id[i] == f"[PAD{i}]":  # the latter: padding a GGUF-born tokenizer carried over
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            text = by_id[i]
            special = added[i].special or (text.startswith("<|") and text.endswith("|>"))
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
            tokens.append(text)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(bpe_pre_tokenizer(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=config.vocab_size)
    if special.chat_template is None and tokenizer.chat_template:
        special.chat_template = tokenizer.chat_template
    if tokenizer.bos_token_id is not None:  # what the tokenizer does, where its config does not say
        special.add_special_token.setdefault("bos", tokenizer("a").input_ids[:1] == [tokenizer.bos_token_id])
    special.add_to_gguf(writer, quiet=True)
    ends = _end_token_ids(model_dir, GenerationConfig)
    other = [i for i in ends if i != special.special_token_ids.get("eos") and i < config.vocab_size]
    if other:  # llama.cpp ends a turn at EOS and EOT; the turn's other end token goes there
        writer.add_eot_token_id(other[0])


def _end_token_ids(model_dir: Path, generation_config_cls) -> list[int]:
    try:
        ends = generation_config_cls.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json
        return []
    return [ends] if isinstance(ends, int) else list(ends or [])


# --------------------------------------------------------------------------------------------------
# The file
# --------------------------------------------------------------------------------------------------
def write_gguf(model_dir: Path, path: Path, gguf_type: str, name: str | None = None,
               workers: int | None = None, importance: dict[str, np.ndarray] | None = None,
               importance_source: str = "") -> Path:
    """Write the checkpoint in `model_dir` (config.json, *.safetensors, tokenizer) as one GGUF of
    `gguf_type` at `path`. Header first, then one tensor at a time (read, converted, written), so memory
    holds one tensor; written beside `path` and renamed, so `path` is never half a file. The k-quants run
    on `workers` processes (default: every core this process may use, up to 16; the numpy arithmetic is
    one core's, the slow part of an export). `importance`: {GGUF name: (cols,) mean squared activation}
    for the k-quants (grpo/export/imatrix.py), checked against the model first (`importance_source`
    names it in that line)."""
    model_dir, path = Path(model_dir), Path(path)
    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    check_convertible(config, tokenizer)
    plan = plan_tensors(model_dir, config, gguf_type)
    if importance is not None:
        check_imatrix(importance, {t.name: t.shape[-1] for t in plan if len(t.shape) == 2}, importance_source)
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[ARCHITECTURES[config.model_type]]])
    _add_model_metadata(writer, config, model_dir, gguf_type, name or model_dir.name)
    _add_tokenizer_metadata(writer, config, model_dir, tokenizer)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for item in plan:
        qtype = gguf.GGMLQuantizationType[item.qtype]
        if item.qtype in ("F32", "F16"):
            dtype = np.float32 if item.qtype == "F32" else np.float16
            nbytes = math.prod(item.shape) * np.dtype(dtype).itemsize
            writer.add_tensor_info(item.name, item.shape, np.dtype(dtype), nbytes)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(item.shape, qtype)
            writer.add_tensor_info(item.name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=qtype)

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    with ExitStack() as cleanup:
        cleanup.callback(partial.unlink, missing_ok=True)
        cleanup.callback(writer.close)
        pool = _kquant_pool(plan, workers, cleanup)
        writer.write_header_to_file(path=partial)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for item in plan:
            try:
                weights = (importance or {}).get(item.name)
                writer.write_tensor_data(encode(_tensor_data(model_dir, config, item), item.qtype, pool, weights))
            except BrokenProcessPool as e:  # the child said why on stderr; this says what to do
                raise RuntimeError(
                    f"{path.name}: the k-quant worker processes stopped (each starts by importing the "
                    "__main__ script: a script that exports must keep its work under `if __name__ == "
                    "'__main__':`); fix: add that guard, or pass workers=1") from e
        writer.close()
        partial.replace(path)
    return path


def _kquant_pool(plan: list[PlannedTensor], workers: int | None, cleanup: ExitStack) -> ProcessPoolExecutor | None:
    """Worker processes for the k-quants of `plan`, shut down with `cleanup`; None when there are none
    to write or one worker. Spawned, not forked: the caller may hold CUDA and torch's threads."""
    if workers is None:  # at most 16: each spawned worker is a new Python that imports the k-quant code
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers = min(cores, 16)
    if workers < 2 or not any(item.qtype in BLOCK_BYTES for item in plan):
        return None
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    cleanup.callback(pool.shutdown, cancel_futures=True)
    return pool


def tensor_types_of(path: Path) -> dict[str, str]:
    """{tensor name: ggml type name} of a GGUF file (for reports and tests)."""
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}

