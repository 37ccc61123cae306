"""FP8 checkpoints on disk: telling one apart, and loading an FP8-Block one into FP8Linear layers.

Owned by `grpo/model/load.py` (the Model room); `grpo/rollout/vllm.py` asks the same question through
`is_fp8_checkpoint`. The format itself (E4M3 codes in 128x128 blocks, `weight_scale_inv`) and the
layer that computes with it are `grpo/kernels/fp8.py`; this module only reads config.json and
safetensors files and builds the model, or writes a model in that format (`save_fp8_block_checkpoint`, what
tests and benchmarks serve to vLLM and Unsloth). Quantizing a model in memory for --load-in-fp8 is
`grpo.kernels.fp8.quantize_linears_`. transformers never sees the quantization_config (its FineGrainedFP8
path fetches a kernel from a hub at run time).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from grpo.kernels.fp8 import BLOCK, FP8_DTYPE, FP8Linear, quantize_fp8_block


def _read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir}: no config.json; pass a local model directory")
    return json.loads(path.read_text())


def is_fp8_checkpoint(model: str | Path) -> bool:
    """An FP8 checkpoint: the config.json in folder `model` declares `quantization_config.quant_method`
    fp8. A hub id (owner/name, no such local folder) counts when its name says FP8: nothing is
    downloaded to ask."""
    if (Path(model) / "config.json").is_file():
        quant = _read_config(model).get("quantization_config") or {}
        return str(quant.get("quant_method", "")).lower() == "fp8"
    hub_id = not Path(model).exists() and str(model).count("/") == 1
    return hub_id and "fp8" in str(model).lower()


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no .safetensors files; FP8-Block checkpoints are read from safetensors")
    return files


def _check_fp8_block_config(model_dir: Path, qc: dict) -> None:
    """One line saying what is wrong when `quantization_config` is not the FP8-Block format we read."""
    if str(qc.get("quant_method", "")).lower() != "fp8":
        raise ValueError(f"{model_dir}: quantization_config.quant_method is {qc.get('quant_method')!r}, not 'fp8'; "
                         "load a bf16 checkpoint with --load-in-fp8 instead")
    if list(qc.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        raise ValueError(f"{model_dir}: weight_block_size {qc.get('weight_block_size')} is not supported; "
                         f"only [{BLOCK}, {BLOCK}] blocks are")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{model_dir}: activation_scheme {qc['activation_scheme']!r} is not supported; "
                         "only 'dynamic' (activations quantized at run time)")


def load_fp8_block_model(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16):
    """Load an FP8-Block checkpoint on the CPU: quantized linears become FP8Linear with the stored codes
    and scales, everything else loads in `dtype`. transformers never sees the quantization_config."""
    model_dir = Path(model_dir)
    _check_fp8_block_config(model_dir, _read_config(model_dir).get("quantization_config") or {})
    config = AutoConfig.from_pretrained(model_dir)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # so transformers never takes its FineGrainedFP8 path
    with init_empty_weights(include_buffers=False):  # parameters on meta; rotary buffers computed
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)

    dense: dict[str, torch.Tensor] = {}
    fp8: dict[str, dict[str, torch.Tensor]] = {}
    for file in _safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                prefix, _, leaf = key.rpartition(".")
                tensor = f.get_tensor(key)
                if leaf == "weight_scale_inv" or tensor.dtype == FP8_DTYPE:
                    fp8.setdefault(prefix, {})[leaf] = tensor
                else:
                    dense[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    for prefix, pair in fp8.items():
        if set(pair) != {"weight", "weight_scale_inv"}:
            raise ValueError(f"{model_dir}: {prefix} has {sorted(pair)}; an FP8 layer needs weight (float8_e4m3fn) "
                             "and weight_scale_inv")
        if pair["weight"].dtype != FP8_DTYPE:
            raise ValueError(f"{model_dir}: {prefix}.weight is {pair['weight'].dtype}; only float8_e4m3fn is supported")
        linear = model.get_submodule(prefix)
        if type(linear) is not nn.Linear or tuple(linear.weight.shape) != tuple(pair["weight"].shape):
            raise ValueError(f"{model_dir}: {prefix} is not an nn.Linear of shape {tuple(pair['weight'].shape)}")
        bias = dense.pop(f"{prefix}.bias", None)
        parent_name, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent_name), child,
                FP8Linear(pair["weight"], pair["weight_scale_inv"], bias, compute_dtype=dtype))

    model.load_state_dict(dense, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return model.eval()


def save_fp8_block_checkpoint(model: nn.Module, path: str | Path, targets: tuple[str, ...] | list[str],
                              shards: int = 1) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Write `model` (a transformers causal LM with plain nn.Linear projections) as an FP8-Block checkpoint,
    the layout of unsloth/Llama-3.2-1B-Instruct-FP8-Block: each Linear named in `targets` as E4M3 codes plus
    float32 `weight_scale_inv` per 128x128 block, everything else bf16, and `quantization_config` in
    config.json. Returns {module name: (codes, scale_inv)} as written."""
    path = Path(path)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state, codes = {}, {}
    for name, tensor in model.state_dict().items():
        module_name, _, leaf = name.rpartition(".")
        if leaf == "weight" and module_name.rsplit(".", 1)[-1] in targets:
            w_fp8, scale_inv = quantize_fp8_block(tensor)
            state[name], state[f"{module_name}.weight_scale_inv"] = w_fp8.contiguous(), scale_inv.contiguous()
            codes[module_name] = (w_fp8, scale_inv)
        elif not (tied and name == "lm_head.weight"):  # tied: the checkpoint stores the embedding only
            state[name] = tensor.to(torch.bfloat16).contiguous()
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.cpu() for k, v in state.items()}
    keys = sorted(state)
    if shards == 1:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: state[k] for k in keys[i::shards]}
            save_file(part, str(path / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return codes
