"""Export a trained adapter: the PEFT adapter as it is, a merged 16-bit model, and GGUF files.

    python -m grpo.export --model smollm2-135m-instruct --adapter outputs/smollm2-arithmetic/adapter \\
        --out exports/smollm2-arithmetic [--dtype bf16|fp16] [--load-in-fp8] [--gguf f16,q8_0,q5_k_m,q4_k_m]
        [--gguf-imatrix auto|FILE] [--gguf-lora [--gguf-lora-base BASE.gguf]]

writes
    OUT/adapter   adapter_config.json + adapter_model.safetensors: the format peft's
                  `PeftModel.from_pretrained` and vLLM's `LoRARequest(name, id, OUT/adapter)` read.
    OUT/merged    config.json + model.safetensors + tokenizer + generation config: a plain checkpoint
                  that `AutoModelForCausalLM.from_pretrained` (and vLLM, llama.cpp converters, ...) load
                  with no peft and no quantization_config.
    OUT/gguf-TYPE/model-TYPE.gguf   with --gguf: the merged model for llama.cpp-style runtimes (and
                  transformers' `gguf_file=`), one folder per type, written from OUT/merged by
                  grpo/export/gguf.py as llama.cpp's converter and quantizer would write it.
    OUT/gguf-imatrix/imatrix.gguf   with --gguf-imatrix auto: the importance matrix the k-quants were
                  weighted by, in llama-imatrix's format (`llama-quantize --imatrix` reads it).
    OUT/gguf-lora/adapter.gguf   with --gguf-lora: the adapter in llama.cpp's LoRA format, for any GGUF
                  of the base (`llama-cli -m BASE.gguf --lora adapter.gguf`; grpo/export/lora_gguf.py).

An --out that holds an export already is refused; --overwrite moves it aside to OUT.old-N.

The merge runs in float32 and rounds once to the 16-bit dtype: W' = W + (alpha/sqrt(r)) B A. An FP8
base (an FP8-Block checkpoint, or --load-in-fp8 as in training) is first dequantized, FP8Linear ->
nn.Linear holding codes x block scales, so the adapter merges onto exactly the weights it was trained
against. What this is not: a quantizer of the merged checkpoint (it is dense 16-bit; the GGUF files are
the quantized forms).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Sequence

import torch
from peft import PeftModel
from safetensors.torch import load_file
from torch import nn

from grpo.cli import OneLineParser, add_bool_flag
from grpo.config import DTYPES as FULL_DTYPE_NAMES
from grpo.config import Config
from grpo.export.gguf import (GGUF_TYPES, check_convertible, gguf_file_name, parse_gguf_types, tensor_name_map,
                              write_gguf)
from grpo.export.imatrix import check_imatrix, collect_imatrix, means, read_imatrix, run_texts, write_imatrix
from grpo.export.lora_gguf import write_lora_gguf
from grpo.kernels.fp8 import FP8Linear
from grpo.model.load import default_device, load_base_model, load_tokenizer
from grpo.quiet import add_verbose_flag
from grpo.run.checkpoint import aside_path
from grpo.run.durable import give_usual_modes
from grpo.run.failures import adapter_load_error, report, write_failure

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
DTYPES = {name: getattr(torch, FULL_DTYPE_NAMES[name]) for name in ("bf16", "fp16")}  # merged weights ship in 16 bits


def find_adapter(path: str | Path) -> Path:
    """The folder holding a PEFT adapter: `path` itself, or `path/adapter` (a run's --output-dir)."""
    path = Path(path)
    for folder in (path, path / "adapter"):
        if all((folder / name).is_file() for name in ADAPTER_FILES):
            try:  # peft would say only what json says, without the file
                json.loads((folder / "adapter_config.json").read_text())
            except ValueError as err:
                raise ValueError(f"--adapter {path}: {folder / 'adapter_config.json'} is not valid JSON ({err}); fix: "
                                 "use an intact copy, e.g. a checkpoint-N folder of the run") from None
            return folder
    raise FileNotFoundError(f"--adapter {path}: no {' and '.join(ADAPTER_FILES)} there; pass a run's adapter folder "
                            "(OUTPUT_DIR/adapter) or a checkpoint-N folder")


def dequantize_fp8_linears_(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Replace, in place, every FP8Linear by an nn.Linear whose weight is its dequantized weight in
    `dtype`. Returns how many were replaced."""
    names = [name for name, module in model.named_modules() if isinstance(module, FP8Linear)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        fp8 = getattr(parent, child)
        dense = nn.Linear(fp8.in_features, fp8.out_features, bias=fp8.bias is not None, dtype=dtype,
                          device=fp8.weight.device)
        with torch.no_grad():
            dense.weight.copy_(fp8.dequantized_weight(dtype))
            if fp8.bias is not None:
                dense.bias.copy_(fp8.bias.to(dtype))
        dense.requires_grad_(False)
        setattr(parent, child, dense)
    return len(names)


def merge_adapter(base: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """The base model with the adapter folded into its weights, as a plain transformers model.

    `base` is consumed (its modules are replaced); FP8Linear layers are dequantized to the dtype of the
    model's other weights first, since peft cannot merge into float8 codes.
    """

    dtype = base.get_input_embeddings().weight.dtype
    dequantize_fp8_linears_(base, dtype)
    merged = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=False).merge_and_unload()
    if hasattr(merged.config, "quantization_config"):
        del merged.config.quantization_config
    return merged.eval()


def adapter_targets(adapter_dir: Path) -> tuple[str, ...] | None:
    """The module names the adapter was trained on (the layers training quantized with --load-in-fp8)."""
    targets = json.loads((adapter_dir / "adapter_config.json").read_text()).get("target_modules")
    return tuple(sorted(targets)) if isinstance(targets, list) and targets else None


def export(model: str, adapter: str | Path, out: str | Path, dtype: str = "bf16", load_in_fp8: bool = False,
           gguf: Sequence[str] | str = (), overwrite: bool = False, gguf_lora: bool = False,
           gguf_lora_base: str | Path | None = None, gguf_imatrix: str | Path | None = None) -> dict[str, Path]:
    """Write OUT/adapter, OUT/merged, OUT/gguf-TYPE/ for each of `gguf` and OUT/gguf-lora/ with `gguf_lora`
    (see the module docstring); returns the paths written, by name ("adapter", "merged", "gguf-q4_k_m",
    "gguf-lora", ...). `gguf_imatrix`: "auto" or a llama.cpp imatrix file, for the k-quant types."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    gguf_types = parse_gguf_types(gguf if isinstance(gguf, str) else ",".join(gguf)) if gguf else ()
    importance = check_imatrix_option(gguf_imatrix, gguf_types)
    adapter_dir = find_adapter(adapter)
    out = Path(out)
    src = adapter_dir.resolve()
    if (out / "adapter").resolve() == src or (out / "merged").resolve() in (src, *src.parents):
        raise ValueError(f"--out {out}: exporting there would overwrite the adapter being exported; choose a new folder")
    claim_export_dir(out, overwrite, src)

    # The adapter, unchanged: the files training wrote are already what peft and vLLM read.
    out_adapter = out / "adapter"
    out_adapter.mkdir(parents=True, exist_ok=True)
    for name in ADAPTER_FILES:
        shutil.copyfile(adapter_dir / name, out_adapter / name)

    # The base in float32 on the CPU (FP8 layers stay FP8 until merge_adapter dequantizes them).
    targets = adapter_targets(adapter_dir)
    cfg = Config(model=model, dtype="fp32", load_in_fp8=load_in_fp8, gradient_checkpointing=False,
                 **({"lora_targets": targets} if targets else {}))
    base, model_dir = load_base_model(cfg, torch.device("cpu"))
    tokenizer = load_tokenizer(model_dir) if gguf_types else None
    if gguf_types:
        check_convertible(base.config, tokenizer)  # before the merge: a model GGUF cannot hold costs nothing
    if importance is not None:  # a file of another model is refused now, not after the merge
        check_imatrix(importance, linear_columns(base), str(gguf_imatrix))
    merged = merge_adapter(base, adapter_dir)
    written = {}
    if gguf_imatrix == "auto":  # from the merged model in float32, before its rounding to 16 bits
        sums, counts, what = auto_imatrix(merged, tokenizer, adapter_dir)
        written["gguf-imatrix"] = write_imatrix(out / "gguf-imatrix" / "imatrix.gguf", sums, counts, what)
        importance = means(sums, counts)
    merged = merged.to(DTYPES[dtype])
    bad = [n for n, p in merged.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise ValueError(f"--dtype {dtype}: {bad[0]} overflows when rounded to {dtype}; use --dtype bf16")
    merged.config.dtype = DTYPES[dtype]

    out_merged = out / "merged"
    merged.save_pretrained(out_merged)
    (tokenizer or load_tokenizer(model_dir)).save_pretrained(out_merged)
    give_usual_modes(out_merged)  # model.safetensors comes out 0600 from safetensors' writer
    del base, merged  # the GGUF files are written from OUT/merged, one tensor at a time
    written = {"adapter": out_adapter, "merged": out_merged, **written}
    if gguf_lora:  # first: it is small, and a base GGUF it does not fit is refused before the long writes
        written["gguf-lora"] = write_lora_gguf(adapter_dir, out_merged, out / "gguf-lora" / "adapter.gguf",
                                               base_gguf=gguf_lora_base, name=out.resolve().name)
    for name in gguf_types:
        folder = f"gguf-{name}"
        written[folder] = write_gguf(out_merged, out / folder / gguf_file_name(name), name, name=out.resolve().name,
                                     importance=importance if GGUF_TYPES[name].mix else None,
                                     importance_source=str(gguf_imatrix))
    return written


def check_imatrix_option(gguf_imatrix: str | Path | None, gguf_types: Sequence[str]) -> dict | None:
    """--gguf-imatrix: goes with a k-quant type; a file is read now (a bad one fails before the model
    loads). Returns the file's importance, or None (none, or auto: collected after the merge)."""
    if gguf_imatrix is None:
        return None
    if not any(GGUF_TYPES[name].mix for name in gguf_types):
        raise ValueError(f"--gguf-imatrix {gguf_imatrix}: weights the k-quants, and --gguf names none; fix: add "
                         "q4_k_m or q5_k_m to --gguf")
    if str(gguf_imatrix) == "auto":
        return None
    if not Path(gguf_imatrix).is_file():
        raise ValueError(f"--gguf-imatrix {gguf_imatrix}: no such file; fix: pass a llama-imatrix file, or auto")
    return read_imatrix(Path(gguf_imatrix))


def linear_columns(model: nn.Module) -> dict[str, int]:
    """{GGUF name: input columns} of the model's linear layers in its layers, as an imatrix names them."""
    names = tensor_name_map(model.config)
    columns = {}
    for module_name, module in model.named_modules():
        target = names.get_name(module_name + ".weight", try_suffixes=(".weight",))
        if target and target.startswith("blk.") and isinstance(getattr(module, "weight", None), torch.Tensor) \
                and module.weight.dim() == 2:
            columns[target] = module.weight.shape[-1]
    return columns


def auto_imatrix(merged: nn.Module, tokenizer, adapter_dir: Path):
    """`--gguf-imatrix auto`: summed squared activations and token counts over the run's own prompts and the
    merged model's completions (grpo/export/imatrix.py), on the GPU when there is one; and what the text was."""
    device = default_device()
    merged.to(device)
    try:
        sequences, what = run_texts(merged, tokenizer, adapter_dir)
        sums, counts = collect_imatrix(merged, sequences, tensor_name_map(merged.config))
    finally:
        merged.to("cpu")
    return sums, counts, what


EXPORT_PARTS = ("adapter", "merged", "gguf-*")


def claim_export_dir(out: Path, overwrite: bool, adapter_dir: Path) -> Path | None:
    """Refuse an --out that holds an export already, unless --overwrite, which moves it aside to
    OUT.old-N (nothing deleted, as training's --overwrite); returns where it went, or None."""
    held = sorted({p.name for part in EXPORT_PARTS for p in out.glob(part)}) if out.is_dir() else []
    if not held:
        return None
    if not overwrite:
        raise ValueError(f"--out {out} holds an export already ({', '.join(held)}); fix: pick a new --out or pass "
                         f"--overwrite to move it aside to {aside_path(out)}")
    if out.resolve() in adapter_dir.resolve().parents:
        raise ValueError(f"--overwrite: --out {out} holds the adapter being exported ({adapter_dir}); fix: pick a "
                         "new --out")
    moved = aside_path(out)
    out.rename(moved)
    return moved


def build_parser():
    """The command line of `python -m grpo.export`."""
    parser = OneLineParser(prog="python -m grpo.export", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True,
                        help="The base the adapter was trained on: local folder, hub id or smollm2-135m-instruct.")
    parser.add_argument("--adapter", required=True,
                        help="Folder with adapter_model.safetensors (OUTPUT_DIR/adapter or a checkpoint-N).")
    parser.add_argument("--out", required=True,
                        help="Output folder; gets adapter/, merged/ and gguf-TYPE/ per --gguf type.")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="dtype of the merged model.")
    parser.add_argument("--gguf", default="", metavar="TYPES",
                        help="Also write GGUF files of the merged model, one folder per type: any of "
                             "f16,bf16,q8_0,q5_k_m,q4_k_m, comma-separated. The smaller the type, the less "
                             "of what training learned it keeps: ship q8_0 (benchmarks/RESULTS.md, \"GGUF "
                             "export\").")
    add_bool_flag(parser, "--gguf-lora",
                  help="Also write the adapter as a llama.cpp LoRA GGUF, OUT/gguf-lora/adapter.gguf: run it on any "
                       "GGUF of the base, e.g. `llama-cli -m BASE.gguf --lora OUT/gguf-lora/adapter.gguf`.")
    parser.add_argument("--gguf-imatrix", default=None, metavar="auto|FILE",
                        help="Weight the k-quants (q4_k_m, q5_k_m) by an importance matrix, as llama-quantize "
                             "--imatrix: auto collects it from the run's own prompts and the merged model's greedy "
                             "completions (written to OUT/gguf-imatrix/imatrix.gguf); FILE is one llama-imatrix "
                             "wrote for this model (.gguf or legacy .dat) (default: none).")
    parser.add_argument("--gguf-lora-base", default=None, metavar="BASE.gguf",
                        help="With --gguf-lora: the base GGUF it will run on; the adapter is checked against its "
                             "architecture and tensor shapes, as llama.cpp will check them, before the LoRA GGUF "
                             "is written (default: no check).")
    add_bool_flag(parser, "--overwrite",
                  help="An --out holding an export is moved aside to OUT.old-N (never deleted); without it such "
                       "a folder is refused.")
    add_bool_flag(parser, "--load-in-fp8",
                  help="The run used --load-in-fp8: quantize the bf16 base as training did before merging.")
    add_bool_flag(parser, "--debug", help="On an error, show the traceback (also GRPO_DEBUG=1).")
    add_verbose_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m grpo.export`: the adapter and --out checked before the model loads; any error is one
    line (status 1)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_export_paths(args.adapter, args.out, args.gguf, args.gguf_lora, args.gguf_lora_base)
        paths = export(args.model, args.adapter, args.out, args.dtype, args.load_in_fp8, args.gguf, args.overwrite,
                       args.gguf_lora, args.gguf_lora_base, args.gguf_imatrix)
    except Exception as err:
        message = adapter_load_error(err, args.adapter, args.model)
        short = None if isinstance(err, OSError) else write_failure(err)  # an OSError names its own path
        if message is None and short is not None:
            message = f"--out {args.out}: could not write the export ({short}); fix: free space there or another --out"
        return report(err, args.debug, message)
    for name, path in paths.items():
        print(f"{name + ':':<13} {path}")
    return 0


def check_export_paths(adapter: str, out: str, gguf: str = "", gguf_lora: bool = False,
                       gguf_lora_base: str | None = None) -> None:
    """Before anything loads or is written: the --gguf types exist, the adapter reads back whole, the
    LoRA GGUF's options go together and --out can be a folder."""
    if gguf:
        parse_gguf_types(gguf)
    if gguf_lora_base is not None and not gguf_lora:
        raise ValueError(f"--gguf-lora-base {gguf_lora_base}: checks the adapter's LoRA GGUF, which is not asked "
                         "for; fix: add --gguf-lora")
    if gguf_lora_base is not None and not Path(gguf_lora_base).is_file():
        raise ValueError(f"--gguf-lora-base {gguf_lora_base}: no such file; fix: pass the base model's .gguf")
    load_file(find_adapter(adapter) / "adapter_model.safetensors")  # a truncated file fails here, not mid-export
    taken = next((p for p in (Path(out), *Path(out).parents) if p.exists()), None)
    if taken is not None and not taken.is_dir():
        raise ValueError(f"--out {out}: {taken} is a file, not a folder; fix: pass a folder path")

