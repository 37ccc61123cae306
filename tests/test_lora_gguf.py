"""grpo.export.lora_gguf through `grpo.export --gguf-lora`: the adapter read back with gguf's reader and
applied as llama.cpp applies it (W + alpha/r * B A on the base GGUF's weights) gives the merged model's
weights; llama.cpp's metadata keys, tensor names and shapes; one-line refusals of what it cannot run on."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo.export.merge import export, main

gguf = pytest.importorskip("gguf")


def rope_order_undone(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary row order (neighbouring pairs) back to Hugging Face's (halves): written here
    from the layouts, not from the exporter's function, so a wrong permutation there fails below."""
    rows = w.shape[0]
    half = rows // n_head // 2
    out = np.empty_like(w)
    for h in range(n_head):
        for i in range(half):
            out[h * 2 * half + i] = w[h * 2 * half + 2 * i]  # first of the pair: the first half
            out[h * 2 * half + half + i] = w[h * 2 * half + 2 * i + 1]
    return out


def applied_as_llama_cpp(path: Path, base: dict[str, torch.Tensor], config) -> dict[str, np.ndarray]:
    """{HF weight name: W + scale * B A} with the file's alpha and B's rank as llama.cpp's get_scale reads
    them, in float64, the q/k rows put back in Hugging Face's order."""
    reader = gguf.GGUFReader(path)
    alpha = float(reader.fields["adapter.lora.alpha"].contents())
    pairs = {}
    for t in reader.tensors:
        target, _, which = t.name.rpartition(".")
        pairs.setdefault(target, {})[which] = (t, np.asarray(t.data, dtype=np.float64))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[config.model_type.upper()], config.num_hidden_layers)
    out = {}
    for key, w in base.items():
        target = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if target not in pairs:
            continue
        (a_info, a), (b_info, b) = pairs[target]["lora_a"], pairs[target]["lora_b"]
        rank = b_info.shape[0]  # ggml's b->ne[0]
        assert list(a_info.shape) == [w.shape[1], rank] and list(b_info.shape) == [rank, w.shape[0]]
        delta = alpha / rank * (b @ a)
        if config.model_type == "llama" and ".attn_q." in target:
            delta = rope_order_undone(delta, config.num_attention_heads)
        elif config.model_type == "llama" and ".attn_k." in target:
            delta = rope_order_undone(delta, config.num_key_value_heads)
        out[key] = w.double().numpy() + delta
    return out


def qwen2_dir(folder: Path) -> Path:
    from test_gguf_export import tiny_qwen2_dir

    return tiny_qwen2_dir(folder, layers=2)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_adapter_applied_as_llama_cpp_does_gives_the_merged_weights(arch, tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file
    from test_export import load_dense, trained_adapter
    from transformers import AutoConfig

    base_dir = tiny_llama_dir if arch == "llama" else qwen2_dir(tmp_path / "qwen2")
    trained_adapter(load_dense(base_dir), tmp_path / "adapter", rank=8)  # rsLoRA, alpha 16
    paths = export(str(base_dir), tmp_path / "adapter", tmp_path / "out", dtype="fp16", gguf_lora=True)
    path = paths["gguf-lora"]
    assert path == tmp_path / "out" / "gguf-lora" / "adapter.gguf"

    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields["general.type"] == "adapter" and fields["adapter.type"] == "lora"
    assert fields["general.architecture"] == arch
    # rsLoRA's scale 16/sqrt(8) as llama.cpp's alpha/r: alpha = 16*sqrt(8), not the config's 16
    assert math.isclose(fields["adapter.lora.alpha"], 16 / math.sqrt(8) * 8, rel_tol=1e-6)
    names = {t.name for t in reader.tensors}
    assert {"blk.0.attn_q.weight.lora_a", "blk.0.attn_q.weight.lora_b", "blk.1.ffn_down.weight.lora_b"} <= names
    assert len(names) == 2 * 7 * 2  # A and B for 7 targets in 2 layers, nothing else
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}

    config = AutoConfig.from_pretrained(base_dir)
    base = {k: v.float() for k, v in load_dense(base_dir).state_dict().items()}
    ours = applied_as_llama_cpp(path, base, config)
    merged = load_file(paths["merged"] / "model.safetensors")
    assert len(ours) == 14
    for key, want in ours.items():
        got = merged[key].double().numpy()
        assert np.abs(want - base[key].numpy()).max() > 1e-2  # the adapter moves this weight: the test can fail
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-4, err_msg=key)  # fp16's rounding


def test_llama_b_rows_are_in_llama_cpps_rotary_order(tiny_llama_dir, tmp_path):
    """B of attn_q as written is the PEFT B with its rows reordered (A is not): the q/k order matters."""
    from safetensors.torch import load_file
    from test_export import load_dense, trained_adapter

    trained_adapter(load_dense(tiny_llama_dir), tmp_path / "adapter", rank=4)
    path = export(str(tiny_llama_dir), tmp_path / "adapter", tmp_path / "out", gguf_lora=True)["gguf-lora"]
    peft = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    written = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    b = peft["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"].numpy()
    a = peft["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].numpy()
    assert not np.array_equal(written["blk.1.attn_q.weight.lora_b"], b)
    assert np.array_equal(rope_order_undone(written["blk.1.attn_q.weight.lora_b"], 4), b)
    assert np.array_equal(written["blk.1.attn_q.weight.lora_a"], a)
    v_b = peft["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].numpy()
    assert np.array_equal(written["blk.1.attn_v.weight.lora_b"], v_b)  # v is not rotated


def one_error_line(capsys) -> str:
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    return line


def test_an_adapter_that_does_not_fit_the_base_gguf_or_llama_cpps_format_is_refused_in_one_line(
        tiny_llama_dir, tmp_path, capsys):
    from conftest import tiny_llama
    from test_export import load_dense, trained_adapter

    from grpo.export.gguf import write_gguf
    from test_gguf_export import small_bpe_dir

    trained_adapter(load_dense(tiny_llama_dir), tmp_path / "adapter", rank=4)
    args = ["--model", str(tiny_llama_dir), "--adapter", str(tmp_path / "adapter"), "--gguf-lora"]

    other_arch = write_gguf(qwen2_dir(tmp_path / "qwen2"), tmp_path / "qwen2.gguf", "f16")
    assert main([*args, "--out", str(tmp_path / "a"), "--gguf-lora-base", str(other_arch)]) == 1
    line = one_error_line(capsys)
    assert f"--gguf-lora-base {other_arch}: its architecture is qwen2, the adapter's base is llama" in line
    assert "fix: pass a GGUF of the model" in line and not (tmp_path / "a" / "gguf-lora").exists()

    narrow = small_bpe_dir(tmp_path / "narrow")  # a llama whose q_proj is 32 wide, not 64
    model = tiny_llama(vocab_size=320, hidden=32, layers=2)
    model.config.bos_token_id, model.config.eos_token_id = 0, 2
    model.save_pretrained(narrow)
    other_shapes = write_gguf(narrow, tmp_path / "narrow.gguf", "f16")
    assert main([*args, "--out", str(tmp_path / "b"), "--gguf-lora-base", str(other_shapes)]) == 1
    assert "blk.0.attn_k.weight is [32, 16] but the adapter's blk.0.attn_k.weight.lora_a is [64, 4]" in \
        one_error_line(capsys)

    assert main([*args, "--out", str(tmp_path / "c"), "--gguf-lora-base", str(tmp_path / "none.gguf")]) == 1
    assert "none.gguf: no such file; fix: pass the base model's .gguf" in one_error_line(capsys)
    assert not (tmp_path / "c").exists()  # refused before anything loads

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["use_dora"] = True  # a type llama.cpp cannot read
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    from grpo.export.lora_gguf import write_lora_gguf

    with pytest.raises(ValueError, match="uses use_dora, which llama.cpp's LoRA format cannot state; fix: export "
                                         "without --gguf-lora"):
        write_lora_gguf(tmp_path / "adapter", tiny_llama_dir, tmp_path / "d.gguf")
    config["use_dora"], config["rank_pattern"] = False, {"q_proj": 2}
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="uses rank_pattern"):
        write_lora_gguf(tmp_path / "adapter", tiny_llama_dir, tmp_path / "d.gguf")
    assert not list(tmp_path.glob("d.gguf*"))
