"""grpo.export.gguf through `grpo.export.merge --gguf`: files that transformers loads (`gguf_file=`) with the
merged model's greedy completions (f16), llama.cpp's metadata keys and tensor names, the per-tensor types
of the _M mixes, and one-line refusals of what cannot be written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo.export.merge import export, main
from grpo.export.gguf import GGUF_TYPES, _more_bits, bpe_pre_tokenizer, parse_gguf_types, tensor_types_of

gguf = pytest.importorskip("gguf")
PROMPTS = ["The answer is", "1 + 2 =", "Once upon a time", "def main():", "Paris is the capital of"]


def trained_adapter(base, folder: Path, seed: int = 3):
    from test_export import trained_adapter as make

    return make(base, folder, seed=seed, rank=4)


def load(folder: Path, gguf_file: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()
    return model, AutoTokenizer.from_pretrained(folder, **kw)


@torch.no_grad()
def greedy(model, tokenizer, n_new: int = 8) -> list[list[int]]:
    outs = []
    for text in PROMPTS:
        ids = tokenizer(text, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=n_new, do_sample=False, pad_token_id=0)
        outs.append(out[0, ids.shape[1]:].tolist())
    return outs


def small_bpe_dir(folder: Path) -> Path:
    """A byte-level BPE tokenizer (GPT-2's pre-tokenizer) trained here on a little text: 300 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([" ".join(PROMPTS * 20), "the quick brown fox jumps over the lazy dog " * 50], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bpe_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama over the small BPE tokenizer: a vocabulary of 320, so files write and load in seconds."""
    from conftest import tiny_llama

    folder = small_bpe_dir(tmp_path_factory.mktemp("bpe-llama"))
    model = tiny_llama(vocab_size=320, hidden=64, layers=2)
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 0, 2, 0
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 0, [2, 1]
    model.save_pretrained(folder)
    return folder


def tiny_qwen2_dir(folder: Path, layers: int = 8, tie: bool = False) -> Path:
    """A random Qwen2 whose rows are whole 256-blocks (k-quants, not their fallbacks), with q/k/v biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    small_bpe_dir(folder)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tie, bos_token_id=0, eos_token_id=2, rope_theta=1e6)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    return folder


def test_export_gguf_f16_loads_in_transformers_with_the_merged_models_greedy_completions(bpe_llama_dir, tmp_path):
    from test_export import load_dense

    trained_adapter(load_dense(bpe_llama_dir), tmp_path / "adapter")
    paths = export(str(bpe_llama_dir), tmp_path / "adapter", tmp_path / "out", gguf="f16,q8_0")
    assert set(paths) == {"adapter", "merged", "gguf-f16", "gguf-q8_0"}
    assert paths["gguf-f16"] == tmp_path / "out" / "gguf-f16" / "model-f16.gguf"

    merged, tokenizer = load(paths["merged"])
    want = greedy(merged, tokenizer)
    f16, f16_tokenizer = load(paths["gguf-f16"].parent, paths["gguf-f16"].name)
    for text in PROMPTS:  # the tokenizer rebuilt from the file's tokens, merges and pre-tokenizer
        assert f16_tokenizer(text).input_ids == tokenizer(text).input_ids
    assert f16_tokenizer.chat_template == tokenizer.chat_template
    assert f16_tokenizer.eos_token == tokenizer.eos_token
    # q and k rows were reordered for llama.cpp and transformers undid it: the weights are the merged ones
    for (name, w), (_, w16) in zip(merged.state_dict().items(), f16.state_dict().items()):
        torch.testing.assert_close(w16, w.to(torch.float16).float(), atol=0, rtol=0, msg=name)
    assert greedy(f16, f16_tokenizer) == want

    q8, _ = load(paths["gguf-q8_0"].parent, paths["gguf-q8_0"].name)
    assert set(tensor_types_of(paths["gguf-q8_0"]).values()) == {"Q8_0", "F32"}
    got = greedy(q8, tokenizer)
    agree = np.mean([a == b for x, y in zip(got, want) for a, b in zip(x, y)])
    assert agree >= 0.8, (agree, got, want)  # 8-bit weights: near-identical next tokens


def test_the_file_holds_the_keys_llama_cpps_converter_writes_for_the_arch(bpe_llama_dir, tmp_path):
    from grpo.assets import smollm2_gguf_path
    from grpo.export.gguf import write_gguf

    path = write_gguf(bpe_llama_dir, tmp_path / "tiny.gguf", "f16")
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.") and k not in (
        "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")}
    assert fields["general.architecture"] == "llama" and fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] == "gpt-2" and fields["llama.vocab_size"] == 320
    assert fields["llama.embedding_length"] == 64 and fields["llama.block_count"] == 2
    assert fields["llama.attention.head_count"] == 4 and fields["llama.attention.head_count_kv"] == 2
    assert fields["llama.rope.dimension_count"] == 16 and fields["llama.rope.freq_base"] == 500000.0
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_F16
    assert fields["tokenizer.ggml.bos_token_id"] == 0 and fields["tokenizer.ggml.eos_token_id"] == 2
    assert fields["tokenizer.ggml.add_bos_token"] is False  # this tokenizer adds no BOS, so llama.cpp must not
    assert fields["tokenizer.ggml.eot_token_id"] == 1  # the turn's other end token, from generation_config
    tokens, types = reader.fields["tokenizer.ggml.tokens"], reader.fields["tokenizer.ggml.token_type"]
    assert tokens.contents(2) == "<|im_end|>" and types.contents(2) == gguf.TokenType.CONTROL
    assert types.contents(100) == gguf.TokenType.NORMAL
    assert tokens.contents(319) == "[PAD319]" and types.contents(319) == gguf.TokenType.UNUSED  # padded to 320
    # llama.cpp's own file of the same arch (the packaged SmolLM2) has no key we lack, but for the ones
    # that describe its origin or its sentencepiece-era tokenizer settings
    theirs = {k for k in gguf.GGUFReader(smollm2_gguf_path()).fields if not k.startswith("GGUF.")}
    origin = {"general.organization", "general.finetune", "general.basename", "general.size_label",
              "general.license", "general.languages", "tokenizer.ggml.add_space_prefix",
              "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id"}
    assert theirs - set(reader.fields) <= origin, theirs - set(reader.fields)
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output_norm.weight", "blk.1.attn_q.weight", "blk.1.attn_k.weight",
            "blk.1.ffn_down.weight", "blk.1.attn_norm.weight", "blk.1.ffn_norm.weight"} <= names
    assert "output.weight" not in names  # tied: the embedding is the output layer


def expected_mix_types(layers: int, default: str) -> dict[str, str]:
    """What llama-quantize's Q4_K_M / Q5_K_M give a dense model with untied output and 256-block rows."""
    want = {"token_embd.weight": default, "output.weight": "Q6_K", "output_norm.weight": "F32"}
    for i in range(layers):
        more = "Q6_K" if i in {0, 3, 6, 7} else default  # use_more_bits for 8 layers
        want.update({f"blk.{i}.attn_q.weight": default, f"blk.{i}.attn_k.weight": default,
                     f"blk.{i}.attn_v.weight": more, f"blk.{i}.attn_output.weight": default,
                     f"blk.{i}.ffn_gate.weight": default, f"blk.{i}.ffn_up.weight": default,
                     f"blk.{i}.ffn_down.weight": more, f"blk.{i}.attn_norm.weight": "F32",
                     f"blk.{i}.ffn_norm.weight": "F32", f"blk.{i}.attn_q.bias": "F32",
                     f"blk.{i}.attn_k.bias": "F32", f"blk.{i}.attn_v.bias": "F32"})
    return want


def test_more_bits_layers_are_llama_cpps():
    assert [i for i in range(8) if _more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(28) if _more_bits(i, 28)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]


@pytest.mark.parametrize("gguf_type,default", [("q4_k_m", "Q4_K"), ("q5_k_m", "Q5_K")])
def test_k_mixes_choose_each_tensors_type_as_llama_quantize_and_load_close_to_f16(tmp_path, gguf_type, default):
    from grpo.export.gguf import write_gguf

    model_dir = tiny_qwen2_dir(tmp_path / "qwen2")
    path = write_gguf(model_dir, tmp_path / "out" / f"{gguf_type}.gguf", gguf_type)
    assert tensor_types_of(path) == expected_mix_types(8, default)
    fields = gguf.GGUFReader(path).fields
    assert fields["general.architecture"].contents() == "qwen2"
    # transformers loads the BPE tokenizer of a qwen2 folder with Qwen2's split
    assert fields["tokenizer.ggml.pre"].contents() == "qwen2"
    assert fields["general.file_type"].contents() == gguf.LlamaFileType[GGUF_TYPES[gguf_type].file_type]
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 2
    assert fields["tokenizer.chat_template"].contents().startswith("{% for m in messages %}")

    reference, tokenizer = load(model_dir)
    quantized, _ = load(path.parent, path.name)
    ids = tokenizer(" ".join(PROMPTS), return_tensors="pt").input_ids
    with torch.no_grad():
        want, got = reference(ids).logits, quantized(ids).logits
    rel = ((got - want).norm() / want.norm()).item()
    # measured 0.19 / 0.12 on this random model (q8_0: 0.017); another random model's logits are ~1.4 away
    assert rel < {"q4_k_m": 0.3, "q5_k_m": 0.18}[gguf_type], rel


def test_rows_that_are_not_whole_blocks_fall_back_as_llama_quantize_does(bpe_llama_dir):
    from transformers import AutoConfig

    from grpo.export.gguf import plan_tensors

    types = {t.name: t.qtype for t in plan_tensors(bpe_llama_dir, AutoConfig.from_pretrained(bpe_llama_dir), "q4_k_m")}
    assert types["token_embd.weight"] == "Q8_0"  # tied output of 64 columns: Q8_0, not Q6_K
    assert types["blk.0.attn_q.weight"] == "Q5_0" and types["blk.0.ffn_down.weight"] == "Q5_0"  # Q4_K's fallback
    assert types["blk.1.attn_v.weight"] == "Q8_0" and types["blk.1.ffn_down.weight"] == "Q8_0"  # Q6_K's (last layer)


def test_pre_tokenizer_names_follow_the_tokenizers(llama_tokenizer, tmp_path):
    from conftest import char_tokenizer
    from transformers import AutoTokenizer

    assert bpe_pre_tokenizer(llama_tokenizer) == "llama-bpe"
    assert bpe_pre_tokenizer(AutoTokenizer.from_pretrained(small_bpe_dir(tmp_path))) == "gpt-2"
    with pytest.raises(ValueError, match="not a byte-level BPE tokenizer.*fix: export without --gguf"):
        bpe_pre_tokenizer(char_tokenizer())


def test_bad_inputs_are_refused_in_one_line_before_anything_is_written(bpe_llama_dir, tmp_path, capsys):
    from transformers import GPT2Config

    from grpo.export.gguf import check_convertible
    from test_export import load_dense

    with pytest.raises(ValueError, match="--gguf f16,q3_k: unknown type q3_k; fix: choose from f16, bf16, q8_0"):
        parse_gguf_types("f16,q3_k")
    assert parse_gguf_types("Q4_K_M, f16,q4_k_m") == ("q4_k_m", "f16")
    with pytest.raises(ValueError, match="cannot write a 'gpt2' model as GGUF; fix: export without --gguf"):
        check_convertible(GPT2Config(), None)

    trained_adapter(load_dense(bpe_llama_dir), tmp_path / "adapter")
    out = tmp_path / "out"
    assert main(["--model", str(bpe_llama_dir), "--adapter", str(tmp_path / "adapter"), "--out", str(out),
                 "--gguf", "f16,q3_k"]) == 1
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert "--gguf f16,q3_k: unknown type q3_k" in line and not out.exists()

    export(str(bpe_llama_dir), tmp_path / "adapter", out)
    with pytest.raises(ValueError, match=r"--out .*out holds an export already \(adapter, merged\); fix: .*--overwrite"):
        export(str(bpe_llama_dir), tmp_path / "adapter", out, gguf="f16")
    first = (out / "merged" / "model.safetensors").read_bytes()
    paths = export(str(bpe_llama_dir), tmp_path / "adapter", out, gguf="f16", overwrite=True)
    assert (tmp_path / "out.old-1" / "merged" / "model.safetensors").read_bytes() == first  # moved, not deleted
    assert paths["gguf-f16"].is_file() and json.loads((out / "merged" / "config.json").read_text())


@pytest.mark.slow
def test_k_quants_written_by_a_pool_equal_one_process_and_an_unguarded_script_gets_one_line(tmp_path):
    import subprocess
    import sys

    from grpo.export.gguf import write_gguf

    model_dir = tiny_qwen2_dir(tmp_path / "qwen2", layers=2)
    one = write_gguf(model_dir, tmp_path / "one.gguf", "q4_k_m", workers=1)
    two = write_gguf(model_dir, tmp_path / "two.gguf", "q4_k_m", workers=2)
    assert one.read_bytes() == two.read_bytes()

    # Spawned workers import the __main__ script: one without the guard re-runs the export in each
    script = tmp_path / "unguarded.py"
    script.write_text("from grpo.export.gguf import write_gguf\n"
                      f"write_gguf({str(model_dir)!r}, {str(tmp_path / 'three.gguf')!r}, 'q4_k_m', workers=2)\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and not list(tmp_path.glob("three.gguf*"))  # nor a partial file
    assert "fix: add that guard, or pass workers=1" in run.stderr.splitlines()[-1]
