"""benchmarks/probes/gguf_ways.py --smoke end to end (what the GPU run does on the packaged Qwen, on SmolLM2 with 4
problems): every way exported, served by llama.cpp (or our engine, for merged) and measured into results.json."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest

PROBES = Path(__file__).resolve().parents[2] / "benchmarks" / "probes"


def test_the_gguf_ways_probe_measures_every_way(llama_cpp_tools, smollm2_export, tmp_path, monkeypatch, capsys):
    from grpo.config import PRESETS, Config
    from grpo.export import imatrix

    run = tmp_path / "run"  # a run's folder as `./dev train` leaves it: its config beside the adapter
    shutil.copytree(smollm2_export["adapter"], run / "adapter")
    Config(**PRESETS["quickstart"]).save(run)
    monkeypatch.setattr(imatrix, "AUTO_PROMPTS", 4)  # --gguf-imatrix auto from fewer, shorter completions: quick
    monkeypatch.setattr(imatrix, "AUTO_COMPLETION_TOKENS", 16)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the server's threads sleep, not spin, on a shared machine
    monkeypatch.syspath_prepend(str(PROBES))
    probe = importlib.import_module("gguf_ways")
    probe.main(["--smoke", "--adapter", str(run / "adapter"), "--out", str(tmp_path / "out"),
                "--llama-cpp", str(llama_cpp_tools.bin)])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(results) == list(probe.WAYS) == [p["way"] for p in printed if "eval/prompts" in p]
    assert [p["way"] for p in printed if "exported_s" in p] == list(probe.WAYS)  # each way's export, then its figure
    for way, result in results.items():
        assert result["eval/prompts"] == 4 and 0 <= result["eval/greedy_accuracy"] <= 1, way
        assert len((tmp_path / "out" / f"eval-{way}.jsonl").read_text().splitlines()) == 4, way
    sizes = {way: result.get("bytes") for way, result in results.items()}
    # what a user downloads: f16 > q8_0 > q4_k_m; the weighted q4_k_m is as large; LoRA-on-base adds the adapter
    assert sizes["merged"] is None and sizes["f16"] > sizes["q8_0"] > sizes["q4_k_m"] == sizes["q4_k_m-imatrix"]
    assert sizes["lora-on-base"] > sizes["base"]
