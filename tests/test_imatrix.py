"""grpo.export.imatrix and `grpo.export --gguf-imatrix`: llama.cpp's imatrix files (GGUF and legacy .dat)
read as llama-quantize reads them, the activations collected from our own forward passes, the k-quant
tensors of a q4_k_m written with them, and one-line refusals of another model's imatrix."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo.export.imatrix import check_imatrix, collect_imatrix, means, read_imatrix, write_imatrix

gguf = pytest.importorskip("gguf")


def legacy_dat(path: Path, entries: dict[str, tuple[int, np.ndarray]]) -> Path:
    """A legacy imatrix as llama-imatrix's save_imatrix_legacy lays it out: values are mean * calls."""
    blob = struct.pack("<i", len(entries))
    for name, (calls, values) in entries.items():
        blob += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", calls, values.size)
        blob += values.astype("<f4").tobytes()
    blob += struct.pack("<i", 7) + struct.pack("<i", 4) + b"data"  # chunk count and dataset: optional trailer
    path.write_bytes(blob)
    return path


def test_imatrix_files_read_back_as_llama_quantize_divides_them(tmp_path):
    rng = np.random.default_rng(0)
    sums = {"blk.0.attn_q.weight": rng.random(64).astype(np.float32) * 50,
            "blk.0.ffn_down.weight": rng.random(128).astype(np.float32)}
    counts = {"blk.0.attn_q.weight": 37, "blk.0.ffn_down.weight": 5}
    path = write_imatrix(tmp_path / "m.imatrix.gguf", sums, counts, "some text")
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.type"].contents() == "imatrix"
    assert reader.fields["imatrix.datasets"].contents() == ["some text"]
    assert {t.name: list(t.shape) for t in reader.tensors}["blk.0.attn_q.weight.in_sum2"] == [64, 1]  # ggml order
    got = read_imatrix(path)
    assert got.keys() == sums.keys()
    for name in sums:
        assert np.array_equal(got[name], sums[name] / np.float32(counts[name])), name

    mean = rng.random(64).astype(np.float32)
    legacy = legacy_dat(tmp_path / "old.dat", {"blk.1.attn_k.weight": (4, mean * 4)})
    assert np.allclose(read_imatrix(legacy)["blk.1.attn_k.weight"], mean, rtol=1e-6)

    (tmp_path / "junk.dat").write_bytes(b"\x05\x00\x00\x00\xff\xff")
    with pytest.raises(ValueError, match=r"--gguf-imatrix .*junk.dat: not a llama.cpp imatrix file .*fix: pass the "
                                         "file llama-imatrix wrote"):
        read_imatrix(tmp_path / "junk.dat")


def test_collected_means_are_the_mean_squared_inputs_of_each_matrix(tiny_llama_dir):
    from test_export import load_dense

    from grpo.export.gguf import tensor_name_map

    model = load_dense(tiny_llama_dir)
    sequences = [[128000, 10, 11, 12, 13], [128000, 50, 60]]
    sums, counts = collect_imatrix(model, sequences, tensor_name_map(model.config))
    layers, per_layer = model.config.num_hidden_layers, 7
    assert len(sums) == layers * per_layer and "output.weight" not in sums  # as llama-imatrix by default
    assert set(counts.values()) == {8}  # every token of both sequences, no padding
    inputs = []
    with torch.no_grad():
        for ids in sequences:
            hidden = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[1]
            inputs.append(model.model.layers[1].input_layernorm(hidden)[0])  # what layer 1's q, k and v read
    want = torch.cat(inputs).double().pow(2).mean(0).float().numpy()
    got = means(sums, counts)
    for name in ("blk.1.attn_q.weight", "blk.1.attn_k.weight", "blk.1.attn_v.weight"):
        np.testing.assert_allclose(got[name], want, rtol=1e-5, err_msg=name)
    assert got["blk.1.ffn_down.weight"].shape == (model.config.intermediate_size,)


def test_another_models_imatrix_is_refused_in_one_line():
    columns = {"blk.0.attn_q.weight": 64, "blk.0.ffn_down.weight": 128}
    with pytest.raises(ValueError, match=r"--gguf-imatrix x.gguf: names blk.9.attn_q.weight, which this model does "
                                         r"not have \(1 such\); fix: pass the imatrix of this model, or auto"):
        check_imatrix({"blk.9.attn_q.weight": np.ones(64, np.float32)}, columns, "x.gguf")
    with pytest.raises(ValueError, match="blk.0.attn_q.weight has 96 columns there, 64 in this model"):
        check_imatrix({"blk.0.attn_q.weight": np.ones(96, np.float32)}, columns, "x.gguf")
    check_imatrix({"blk.0.attn_q.weight": np.ones(64, np.float32)}, columns, "x.gguf")  # a part of the model is fine


def test_export_auto_imatrix_weights_the_k_quants_with_what_it_wrote(tmp_path, monkeypatch):
    import json

    from test_export import load_dense, trained_adapter
    from test_gguf_export import tiny_qwen2_dir

    from grpo.export import imatrix
    from grpo.export.kquants import quantize_k
    from grpo.export.merge import export

    monkeypatch.setattr(imatrix, "AUTO_PROMPTS", 2)  # a few tokens: the test is about where they go
    monkeypatch.setattr(imatrix, "AUTO_COMPLETION_TOKENS", 6)
    base_dir = tiny_qwen2_dir(tmp_path / "qwen2", layers=2)
    run = tmp_path / "run"
    trained_adapter(load_dense(base_dir), run / "adapter", rank=4)
    (run / "config.json").write_text(json.dumps({"dataset": "arithmetic", "system_prompt": "Answer.", "seed": 1}))
    paths = export(str(base_dir), run, tmp_path / "out", gguf="q4_k_m", gguf_imatrix="auto")
    assert paths["gguf-imatrix"] == tmp_path / "out" / "gguf-imatrix" / "imatrix.gguf"
    importance = read_imatrix(paths["gguf-imatrix"])
    assert "2 arithmetic training prompts" in gguf.GGUFReader(paths["gguf-imatrix"]).fields[
        "imatrix.datasets"].contents()[0]

    plain = export(str(base_dir), run, tmp_path / "plain", gguf="q4_k_m")["gguf-q4_k_m"]
    from safetensors.torch import load_file

    merged = load_file(paths["merged"] / "model.safetensors")
    weighted = {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in gguf.GGUFReader(paths["gguf-q4_k_m"]).tensors}
    unweighted = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(plain).tensors}
    qtype, data = weighted["blk.0.ffn_up.weight"]  # Q4_K; the llama-arch q/k reordering does not apply to qwen2
    assert qtype == "Q4_K"
    source = merged["model.layers.0.mlp.up_proj.weight"].float().numpy()
    want = quantize_k(source, gguf.GGMLQuantizationType.Q4_K, importance=importance["blk.0.ffn_up.weight"])
    assert np.array_equal(data, want)
    assert not np.array_equal(data, unweighted["blk.0.ffn_up.weight"])  # the importance changed the blocks
    assert np.array_equal(weighted["blk.0.attn_norm.weight"][1], unweighted["blk.0.attn_norm.weight"])


def test_imatrix_options_that_cannot_work_are_refused_in_one_line(tmp_path, capsys, tiny_llama_dir):
    from test_export import load_dense, trained_adapter

    from grpo.export.merge import main

    trained_adapter(load_dense(tiny_llama_dir), tmp_path / "adapter", rank=4)
    args = ["--model", str(tiny_llama_dir), "--adapter", str(tmp_path / "adapter")]

    def error_line():
        [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
        return line

    assert main([*args, "--out", str(tmp_path / "a"), "--gguf", "f16", "--gguf-imatrix", "auto"]) == 1
    assert "--gguf-imatrix auto: weights the k-quants, and --gguf names none; fix: add q4_k_m" in error_line()
    assert main([*args, "--out", str(tmp_path / "b"), "--gguf", "q4_k_m", "--gguf-imatrix", "none.gguf"]) == 1
    assert "--gguf-imatrix none.gguf: no such file" in error_line()
    other = write_imatrix(tmp_path / "other.gguf", {"blk.0.attn_q.weight": np.ones(96, np.float32)},
                          {"blk.0.attn_q.weight": 1}, "x")
    assert main([*args, "--out", str(tmp_path / "c"), "--gguf", "q4_k_m", "--gguf-imatrix", str(other)]) == 1
    assert "blk.0.attn_q.weight has 96 columns there, 64 in this model; fix: pass the imatrix of this model" in \
        error_line()
    assert not (tmp_path / "c" / "merged").exists()  # refused before the merge, not after it
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_batched_greedy_completions_are_each_prompts_own(tmp_path):
    from test_gguf_export import tiny_qwen2_dir
    from transformers import AutoModelForCausalLM

    from grpo.export.imatrix import greedy_sequences

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir(tmp_path / "qwen2", layers=2), dtype=torch.float32)
    prompts = [[5, 9, 17, 40, 41, 100], [7, 3], [11, 12, 13]]

    def one_at_a_time():
        return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=12, do_sample=False, pad_token_id=1)[0].tolist() for p in prompts]

    assert greedy_sequences(model, prompts, 12, pad_id=1) == one_at_a_time()
    # an end id that one row writes early: that row stops there, the others run on
    model.generation_config.eos_token_id = one_at_a_time()[1][len(prompts[1]) + 2]
    want = one_at_a_time()
    assert len(want[1]) == len(prompts[1]) + 3 and any(len(w) == len(p) + 12 for w, p in zip(want, prompts))
    assert greedy_sequences(model, prompts, 12, pad_id=1) == want
