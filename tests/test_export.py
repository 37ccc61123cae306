"""grpo.export.merge: the PEFT adapter copied as trained, and a merged 16-bit model whose outputs match the
adapter applied on the base (dense, or FP8 dequantized first)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from grpo.config import LORA_TARGETS, Config
from grpo.export.merge import dequantize_fp8_linears_, export, find_adapter, merge_adapter
from grpo.kernels.fp8 import FP8Linear, quantize_linears_
from grpo.model.load import add_lora

IDS = torch.tensor([[128000, 791, 4062, 220, 18, 489, 220, 19, 284, 30, 4815, 1115],
                    [128000, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]])  # (2, 12)
FP8_QCONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def load_dense(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def trained_adapter(base, folder: Path, seed: int = 5, rank: int = 8):
    """rsLoRA on every target with non-zero B (as after training), saved in PEFT format; returns the policy."""
    cfg = Config(model="unused", lora_rank=rank, lora_alpha=16, gradient_checkpointing=False)
    policy = add_lora(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    policy.save_pretrained(folder)
    return policy.eval()


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model(input_ids=IDS).logits.float()


def test_merged_fp32_model_matches_base_plus_adapter(tiny_llama_dir, tmp_path):
    policy = trained_adapter(load_dense(tiny_llama_dir), tmp_path / "adapter")
    expected = logits(policy)
    with policy.disable_adapter():
        base_out = logits(policy)
    assert (expected - base_out).abs().max() > 1e-2  # the adapter changes the outputs: the test can fail
    merged = merge_adapter(load_dense(tiny_llama_dir), tmp_path / "adapter")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged), expected, atol=1e-5, rtol=1e-5)


@pytest.fixture
def group_writable_umask():
    """umask 002 for the test (a shared machine's usual one): files should come out 0664, not 0600."""
    old = os.umask(0o002)
    yield 0o664
    os.umask(old)


def test_export_writes_the_adapter_unchanged_and_a_bf16_model_that_reloads_and_matches(tiny_llama_dir, tmp_path,
                                                                                       group_writable_umask):
    from peft import PeftModel

    policy = trained_adapter(load_dense(tiny_llama_dir), tmp_path / "run" / "adapter")
    expected = logits(policy)
    paths = export(str(tiny_llama_dir), tmp_path / "run", tmp_path / "out")  # a run folder finds run/adapter

    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (paths["adapter"] / name).read_bytes() == (tmp_path / "run" / "adapter" / name).read_bytes()
    reloaded_adapter = PeftModel.from_pretrained(load_dense(tiny_llama_dir), paths["adapter"]).eval()
    assert reloaded_adapter.peft_config["default"].use_rslora
    torch.testing.assert_close(logits(reloaded_adapter), expected, atol=1e-5, rtol=1e-5)

    for folder in (paths["adapter"], paths["merged"]):  # model.safetensors too, not safetensors' 0600
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_file()}
        assert set(modes.values()) == {group_writable_umask}, modes

    config = json.loads((paths["merged"] / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert (paths["merged"] / "tokenizer.json").is_file() and (paths["merged"] / "generation_config.json").is_file()
    merged = load_dense(paths["merged"], dtype=None)
    assert merged.dtype == torch.bfloat16
    # Merged in fp32, rounded once: every weight equals the fp32 merge rounded to bf16, bit for bit.
    exact = merge_adapter(load_dense(tiny_llama_dir), tmp_path / "run" / "adapter").state_dict()
    for name, w in merged.state_dict().items():
        assert torch.equal(w, exact[name].to(torch.bfloat16)), name
    torch.testing.assert_close(logits(merged), expected, atol=3e-2, rtol=0)  # bf16 weights and activations


def fp8_checkpoint(tiny_llama_dir, folder: Path) -> Path:
    """The tiny Llama quantized to FP8 128x128 blocks and saved as an FP8-Block checkpoint."""
    from transformers import AutoTokenizer

    model = load_dense(tiny_llama_dir)
    quantize_linears_(model, LORA_TARGETS)
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_QCONFIG}))
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(folder)
    return folder


def quantize_and_return(model):
    quantize_linears_(model, LORA_TARGETS)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("source", ["fp8_block_checkpoint", "load_in_fp8"])
def test_export_of_an_fp8_base_merges_onto_the_dequantized_weights(tiny_llama_dir, tmp_path, source, monkeypatch):
    from grpo.model.fp8_checkpoint import load_fp8_block_model

    if source == "fp8_block_checkpoint":
        model_dir = fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8")
        fresh_base = lambda: load_fp8_block_model(model_dir, torch.float32)  # noqa: E731
    else:  # a bf16/fp32 checkpoint that training quantized on load
        model_dir = tiny_llama_dir
        fresh_base = lambda: quantize_and_return(load_dense(tiny_llama_dir))  # noqa: E731
    base = fresh_base()
    assert sum(isinstance(m, FP8Linear) for m in base.modules()) == 7 * 2
    policy = trained_adapter(base, tmp_path / "adapter")  # trained against the FP8 weights
    expected = logits(policy)
    layer = policy.get_base_model().model.layers[1].mlp.down_proj
    w_ref = (layer.base_layer.dequantized_weight(torch.float64)  # float64: W_deq + (alpha/sqrt(r)) B A
             + layer.scaling["default"] * layer.lora_B["default"].weight.double() @ layer.lora_A["default"].weight.double())

    merged_fp32 = merge_adapter(fresh_base(), tmp_path / "adapter")
    assert not any(isinstance(m, FP8Linear) for m in merged_fp32.modules())
    torch.testing.assert_close(merged_fp32.model.layers[1].mlp.down_proj.weight.double(), w_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(logits(merged_fp32), expected, atol=1e-5, rtol=1e-5)

    paths = export(str(model_dir), tmp_path / "adapter", tmp_path / "out", dtype="fp16",
                   load_in_fp8=source == "load_in_fp8")
    config = json.loads((paths["merged"] / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float16"
    merged = load_dense(paths["merged"], dtype=None)
    assert all(w.dtype == torch.float16 for w in merged.state_dict().values())
    torch.testing.assert_close(logits(merged), expected, atol=5e-3, rtol=0)

    if source == "fp8_block_checkpoint":  # GGUF is written from the merged, dequantized weights
        pytest.importorskip("gguf")
        from grpo.export import gguf as gguf_export

        # each tensor's values as the writer reads them to encode (reading the file back parses this 128k-token
        # vocabulary: a minute on two cores; tests/test_gguf_export.py reads files back)
        tensor_data, read = gguf_export._tensor_data, {}

        def reading(model_dir, config, item):
            read[item.name] = tensor_data(model_dir, config, item)
            return read[item.name]

        monkeypatch.setattr(gguf_export, "_tensor_data", reading)
        gguf_path = export(str(model_dir), tmp_path / "adapter", tmp_path / "out", dtype="fp16", gguf="f16",
                           overwrite=True)["gguf-f16"]
        assert gguf_path.is_file()
        merged_layer = load_dense(paths["merged"]).model.layers[1]  # down_proj's (no row reordering, unlike q and
        for name, w in (("blk.1.ffn_down.weight", merged_layer.mlp.down_proj.weight),  # k's) and the norm's
                        ("blk.1.ffn_norm.weight", merged_layer.post_attention_layernorm.weight)):
            torch.testing.assert_close(torch.from_numpy(read[name]), w.float(), atol=0, rtol=0, msg=name)


def test_dequantize_fp8_linears_gives_plain_linears_with_the_dequantized_weight(tiny_llama_dir):
    model = quantize_and_return(load_dense(tiny_llama_dir))
    q_proj = model.model.layers[0].self_attn.q_proj
    want = q_proj.dequantized_weight(torch.float32)
    assert dequantize_fp8_linears_(model) == 14
    dense = model.model.layers[0].self_attn.q_proj
    assert type(dense) is torch.nn.Linear and not dense.weight.requires_grad
    assert torch.equal(dense.weight, want)
    assert dequantize_fp8_linears_(model) == 0


def test_cli_exports_and_reports_both_folders(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    from conftest import run_as_main

    policy = trained_adapter(load_dense(tiny_llama_dir), tmp_path / "adapter", rank=4)
    expected = logits(policy)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = run_as_main(["-m", "grpo.export", "--model", tiny_llama_dir, "--adapter", tmp_path / "adapter", "--out",
                        tmp_path / "out", "--dtype", "bf16"], monkeypatch)
    said = capsys.readouterr()
    assert code == 0, said.err[-3000:]
    assert str(tmp_path / "out" / "merged") in said.out
    torch.testing.assert_close(logits(load_dense(tmp_path / "out" / "merged")), expected, atol=3e-2, rtol=0)


def test_bad_inputs_give_one_line_errors_naming_the_fix(tiny_llama_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="--adapter .*adapter_model.safetensors"):
        find_adapter(tmp_path)
    policy = trained_adapter(load_dense(tiny_llama_dir), tmp_path / "adapter")
    with pytest.raises(ValueError, match="would overwrite the adapter"):
        export(str(tiny_llama_dir), tmp_path / "adapter", tmp_path)
    with pytest.raises(ValueError, match="--dtype fp8"):
        export(str(tiny_llama_dir), tmp_path / "adapter", tmp_path / "out", dtype="fp8")
    with torch.no_grad():  # a merged weight beyond fp16's 65504
        policy.get_base_model().model.layers[0].self_attn.v_proj.lora_B["default"].weight.fill_(1e5)
    policy.save_pretrained(tmp_path / "huge")
    with pytest.raises(ValueError, match="overflows .* use --dtype bf16"):
        export(str(tiny_llama_dir), tmp_path / "huge", tmp_path / "out16", dtype="fp16")


def test_cli_faults_are_one_line_naming_the_path_without_a_traceback(tiny_llama_dir, tmp_path, capsys):
    from conftest import tiny_llama
    from grpo.export.merge import main

    trained_adapter(load_dense(tiny_llama_dir), tmp_path / "adapter", rank=4)
    other = tmp_path / "other-base"  # another architecture: hidden 32 where the adapter was trained on 64
    tiny_llama(hidden=32, intermediate=64).save_pretrained(other)

    def one_line(argv: list[str]) -> str:
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err
        [line] = [x for x in err.splitlines() if x.startswith("error:")]
        return line

    base = ["--model", str(tiny_llama_dir), "--out", str(tmp_path / "out")]
    assert "--adapter" in one_line([*base, "--adapter", str(tmp_path / "missing")])
    (tmp_path / "file").write_text("x")
    line = one_line(["--model", str(tiny_llama_dir), "--adapter", str(tmp_path / "adapter"), "--out",
                     str(tmp_path / "file" / "sub")])
    assert f"--out {tmp_path / 'file' / 'sub'}" in line and "is a file" in line
    line = one_line(["--model", str(other), "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "o2")])
    assert f"--adapter {tmp_path / 'adapter'} does not fit --model {other}" in line and "size mismatch" in line
    shutil.copytree(tmp_path / "adapter", tmp_path / "cut")
    weights = tmp_path / "cut" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    line = one_line([*base, "--adapter", str(tmp_path / "cut")])
    assert str(tmp_path / "cut") in line and "unreadable" in line
    assert not (tmp_path / "out").exists()  # refused before anything was written
