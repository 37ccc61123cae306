"""The trained adapter as a llama.cpp LoRA GGUF: any GGUF of the base (f16, or a q4_k_m) runs it with
`llama-cli -m BASE.gguf --lora adapter.gguf`.

    write_lora_gguf(Path("outputs/run/adapter"), Path("exports/run/merged"), Path("exports/run/gguf-lora/adapter.gguf"))

What llama.cpp's loader (src/llama-adapter.cpp) reads, and what its converter (convert_lora_to_gguf.py) writes:
- `general.type` "adapter", `general.architecture` the base's (llama.cpp refuses another arch),
  `adapter.type` "lora", `adapter.lora.alpha`;
- per adapted matrix `blk.N.attn_q.weight.lora_a` and `.lora_b`, the base tensor's GGUF name plus a
  suffix: A as PEFT holds it (r, in), B (out, r); in ggml's order A is [in, r] and B [r, out], and the
  loader checks them against the base tensor [in, out];
- for arch `llama` the rows of B for attn_q and attn_k in llama.cpp's rotary order, as the merged
  model's GGUF reorders the q and k rows (`llama_rope_order`): (P B) A = P (B A), A untouched.

llama.cpp applies W x + s * B (A x) with s = alpha / r, r read from B's shape. Our adapters are rsLoRA
(s = alpha / sqrt(r)) or plain LoRA (s = alpha / r), so the file's alpha is s * r, the alpha that makes
llama.cpp's alpha / r our scale (PEFT's converter writes the config's alpha as it is, which is wrong
for rsLoRA). A and B are F32: the adapter exactly as trained, a few percent of a 4-bit base's bytes
(llama.cpp reads F16 too, at a rounding of A and B that buys nothing worth having here).

Not here: DoRA, per-module ranks or alphas (rank_pattern / alpha_pattern: one alpha per file cannot
state them), adapters on the embeddings or the output layer, and the merge (grpo/export/merge.py).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file
from transformers import AutoConfig

from grpo.export.gguf import ARCHITECTURES, check_arch, llama_rope_order

LORA_SUFFIXES = {"lora_A": ".lora_a", "lora_B": ".lora_b"}  # PEFT's matrix name -> llama.cpp's tensor suffix
PEFT_PREFIX = "base_model.model."


def lora_scale(adapter_config: dict) -> float:
    """The factor the adapter's product is added with: alpha / sqrt(r) for rsLoRA, else alpha / r."""
    r, alpha = adapter_config["r"], adapter_config["lora_alpha"]
    return alpha / math.sqrt(r) if adapter_config.get("use_rslora") else alpha / r


def llama_cpp_alpha(adapter_config: dict) -> float:
    """The `adapter.lora.alpha` for which llama.cpp's alpha / r is our scale (see the module docstring)."""
    return lora_scale(adapter_config) * adapter_config["r"]


def check_lora_config(adapter_config: dict, where: Path) -> None:
    """Refuse, in one line, an adapter that llama.cpp's LoRA format cannot state."""
    if adapter_config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"--gguf-lora: {where} is a {adapter_config['peft_type']} adapter; llama.cpp reads LoRA "
                         "only; fix: export without --gguf-lora (the merged GGUF holds it)")
    unstated = [key for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save")
                if adapter_config.get(key)]
    if unstated:
        raise ValueError(f"--gguf-lora: {where} uses {unstated[0]}, which llama.cpp's LoRA format cannot state; "
                         "fix: export without --gguf-lora and run the merged model's GGUF (--gguf)")
    if not adapter_config.get("lora_alpha"):
        raise ValueError(f"--gguf-lora: {where} has lora_alpha 0, which llama.cpp reads as a scale of 1; fix: "
                         "export without --gguf-lora")


def lora_tensors(adapter_dir: Path, config) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) of every A and B, in the order the converter writes them (by layer);
    B's rows reordered for llama.cpp's rotary layout where the arch needs it."""
    arch = gguf.MODEL_ARCH[ARCHITECTURES[config.model_type]]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    heads = {".attn_q.": config.num_attention_heads,
             ".attn_k.": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
    out = []
    for key, value in load_file(adapter_dir / "adapter_model.safetensors").items():
        module, _, rest = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        which = "lora_" + rest.split(".")[0]
        name = names.get_name(module + ".weight", try_suffixes=(".weight",)) if which in LORA_SUFFIXES else None
        if name is None or not name.startswith("blk."):
            raise ValueError(f"--gguf-lora: {adapter_dir} holds {key}, which has no llama.cpp LoRA tensor for arch "
                             f"{config.model_type}; fix: export without --gguf-lora (the merged GGUF holds it)")
        data = value.float().numpy()
        if which == "lora_B" and config.model_type == "llama":
            head_count = next((n for part, n in heads.items() if part in name), None)
            data = llama_rope_order(data, head_count) if head_count else data
        out.append((name + LORA_SUFFIXES[which], np.ascontiguousarray(data, dtype=np.float32)))
    return sorted(out, key=lambda item: (int(item[0].split(".")[1]), item[0]))


def base_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """{GGUF name: ggml shape [in, out]} of the base's matrices, from a checkpoint folder's safetensors."""
    from safetensors import safe_open

    config = AutoConfig.from_pretrained(model_dir)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[ARCHITECTURES[config.model_type]], config.num_hidden_layers)
    shapes = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(file, framework="np") as f:
            for key in f.keys():
                name = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if name is not None:
                    shapes[name] = tuple(reversed(f.get_slice(key).get_shape()))
    return shapes


def gguf_base_shapes(path: Path) -> tuple[str, dict[str, tuple[int, ...]]]:
    """(general.architecture, {tensor name: ggml shape}) of a model GGUF."""
    reader = gguf.GGUFReader(path)
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else ""
    return arch, {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}


def check_fits_base(tensors: list[tuple[str, np.ndarray]], arch: str, shapes: dict[str, tuple[int, ...]],
                    base: str, want_arch: str) -> None:
    """One line when the adapter's tensors would not load onto `base` (as llama.cpp's loader checks: the
    arch, each base tensor present, A [in, r] and B [r, out] against the base's [in, out])."""
    if arch != want_arch:
        raise ValueError(f"--gguf-lora-base {base}: its architecture is {arch or 'not stated'}, the adapter's base "
                         f"is {want_arch}; fix: pass a GGUF of the model the adapter was trained on")
    for name, data in tensors:
        target, _, suffix = name.rpartition(".")
        if target not in shapes:
            raise ValueError(f"--gguf-lora-base {base}: has no tensor {target} for the adapter's {name}; fix: pass a "
                             "GGUF of the model the adapter was trained on")
        ggml_shape = tuple(reversed(data.shape))  # A: [in, r], B: [r, out]
        n_in, n_out = shapes[target][:2]
        fits = ggml_shape[0] == n_in if suffix == "lora_a" else ggml_shape[1] == n_out
        if not fits:
            raise ValueError(f"--gguf-lora-base {base}: {target} is {list(shapes[target])} but the adapter's {name} "
                             f"is {list(ggml_shape)}; fix: pass a GGUF of the model the adapter was trained on")


def write_lora_gguf(adapter_dir: Path, model_dir: Path, path: Path, base_gguf: Path | None = None,
                    name: str | None = None) -> Path:
    """Write the PEFT adapter in `adapter_dir` as a llama.cpp LoRA GGUF at `path`, for the base whose
    config.json and safetensors are in `model_dir` (the base or the merged checkpoint: same shapes). With
    `base_gguf`, the adapter is first checked against that file as llama.cpp's loader will check it."""
    adapter_dir, model_dir, path = Path(adapter_dir), Path(model_dir), Path(path)
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    check_lora_config(adapter_config, adapter_dir)
    config = AutoConfig.from_pretrained(model_dir)
    check_arch(config, "--gguf-lora")
    arch_name = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[ARCHITECTURES[config.model_type]]]
    tensors = lora_tensors(adapter_dir, config)
    check_fits_base(tensors, arch_name, base_shapes(model_dir), str(model_dir), arch_name)
    if base_gguf is not None:
        check_fits_base(tensors, *gguf_base_shapes(base_gguf), str(base_gguf), arch_name)

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    writer = gguf.GGUFWriter(path=str(partial), arch=arch_name)
    try:  # written beside `path` and renamed: `path` is never half a file
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_name(name or adapter_dir.resolve().name)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, llama_cpp_alpha(adapter_config))
        for tensor_name, data in tensors:
            writer.add_tensor(tensor_name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        partial.replace(path)
    finally:
        writer.close()
        partial.unlink(missing_ok=True)
    return path
