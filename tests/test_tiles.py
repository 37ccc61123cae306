"""grpo.kernels.tiles: the tuned tables load and hold only tiles the kernels take, a device finds its own table
(or the guess), the writer round-trips, and the attention's programs follow the device's SM count."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from grpo.kernels import decode_attention as da
from grpo.kernels import tiles
from grpo.kernels.tiles import AttentionTiles, DeviceTable, TileConfig

LLAMA_GATE_UP = ("gated", 16384, 2048, False)


@pytest.fixture
def fake_gpus(monkeypatch):
    """torch.cuda's device properties from a {index: (capability, SMs)} the test fills; the tables read fresh."""
    gpus: dict[int, tuple[tuple[int, int], int]] = {}
    asked = []

    def properties(index):
        asked.append(index)
        (major, minor), sms = gpus[index]
        return SimpleNamespace(major=major, minor=minor, multi_processor_count=sms)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    tiles._cuda_table.cache_clear()
    yield gpus, asked
    tiles._cuda_table.cache_clear()


def test_every_table_loads_and_holds_only_tiles_the_kernels_take():
    paths = sorted(tiles.TABLES.glob("*.json"))
    assert "sm90-132sm.json" in [p.name for p in paths]  # the device today's tiles were swept on
    for path in paths:
        major, minor, sms = map(int, re.fullmatch(r"sm(\d+)(\d)-(\d+)sm", path.stem).groups())
        assert tiles.device_key((major, minor), sms) == path.stem
        table = tiles.load_table(path, sms)
        assert set(table.gemm) <= {16, 32, 64} and any(table.gemm.values())
        for section in table.gemm.values():
            for (kind, n, k, fp8, activations), cfg in section.items():
                assert kind in ("proj", "gated") and n > 0 and k > 0
                assert activations == "bf16" or (activations == "fp16" and fp8)  # fp16: W x^T, FP8 weights only
                assert tiles.tile_problem(kind, fp8, cfg) is None, (path.name, kind, n, k, fp8, cfg)
        assert table.attention.block_s >= 16 and table.attention.programs_per_sm >= 1


def test_a_bad_entry_is_refused_naming_the_file_and_the_rule(tmp_path):
    path = tmp_path / "sm90-132sm.json"
    entry = dict(kind="proj", n=2048, k=2048, fp8=True, block_n=48, block_k=256, num_warps=4, stages=3, split_k=1)
    path.write_text(json.dumps({"decode_gemm": {"16": [entry]}}))
    with pytest.raises(ValueError, match=r"sm90-132sm\.json.*block_n must divide 128.*--write-table"):
        tiles.load_table(path, 132)


def test_a_matching_device_reads_its_table_and_any_other_gets_the_guess():
    tuned = tiles.table_for((9, 0), 132)
    assert tuned.gemm_tiles(LLAMA_GATE_UP, 16) == TileConfig(32, 256, 4, 4)
    assert tuned.gemm_tiles(LLAMA_GATE_UP, 64) == TileConfig(32, 128, 4, 4)  # swept again at 64 rows
    for capability, sms in (((9, 0), 114), ((8, 9), 58), ((8, 0), 108)):  # no table: the same SMs or capability
        other = tiles.table_for(capability, sms)
        assert other.key == tiles.device_key(capability, sms) and not other.gemm
        assert other.gemm_tiles(LLAMA_GATE_UP, 16) == tiles.untuned_gemm_tiles("gated", 16384, 2048, sms)
        assert other.attention == AttentionTiles()


def test_a_launch_takes_the_sweep_at_its_rows_then_at_fewer_then_at_more():
    a, b, c = ("proj", 1, 1, False), ("proj", 2, 1, False), ("proj", 3, 1, False)
    at16, at64 = TileConfig(16, 256, 4, 4), TileConfig(64, 128, 4, 2)
    table = DeviceTable("x", 132, {16: {a: at16, c: at16}, 64: {a: at64, b: at64}})
    assert [table.gemm_tiles(a, m) for m in (16, 32, 64)] == [at16, at16, at64]
    assert [table.gemm_tiles(b, m) for m in (16, 32, 64)] == [at64] * 3
    assert [table.gemm_tiles(c, m) for m in (16, 32, 64)] == [at16] * 3


def test_cuda_devices_read_their_capability_and_sm_count_once_each(fake_gpus):
    gpus, asked = fake_gpus
    gpus.update({0: ((9, 0), 132), 1: ((8, 9), 58)})
    first, second = torch.device("cuda", 0), torch.device("cuda", 1)
    assert tiles.device_table(first).key == "sm90-132sm" and tiles.device_table(first).gemm
    assert tiles.device_table(second).key == "sm89-58sm" and not tiles.device_table(second).gemm
    assert sorted(asked) == [0, 1]
    assert tiles.device_table(torch.device("cpu")).sm_count == tiles.HOST_SM_COUNT


def test_write_table_round_trips_and_keeps_what_it_does_not_replace(tmp_path):
    path = tmp_path / "sm89-58sm.json"
    first = {16: {LLAMA_GATE_UP: TileConfig(32, 256, 4, 4), ("proj", 2048, 8192, True): TileConfig(32, 256, 4, 4, 4)},
             64: {("proj", 1536, 1536, False): TileConfig(16, 256, 4, 4)}}
    tiles.write_table(path, gemm=first)
    assert tiles.load_table(path, 58).gemm == keyed(first)
    assert "decode_attention" not in json.loads(path.read_text())  # nothing swept: the defaults stay defaults
    swept = AttentionTiles(block_s=32, num_warps=8, stages=2, programs_per_sm=4)
    tiles.write_table(path, gemm={16: {LLAMA_GATE_UP: TileConfig(64, 128, 8, 3)}}, attention=swept)
    tiles.write_table(path, gemm={32: {LLAMA_GATE_UP: TileConfig(16, 512, 2, 4)}})
    read = tiles.table_for((8, 9), 58, folder=tmp_path)
    assert read.gemm == keyed({16: {**first[16], LLAMA_GATE_UP: TileConfig(64, 128, 8, 3)}, 32: {
        LLAMA_GATE_UP: TileConfig(16, 512, 2, 4)}, 64: first[64]})
    assert read.attention == swept and read.sm_count == 58
    with pytest.raises(ValueError, match="only projections take it"):
        tiles.write_table(path, gemm={16: {LLAMA_GATE_UP: TileConfig(32, 256, 4, 4, split_k=2)}})
    assert tiles.load_table(path, 58).gemm == read.gemm  # a refused write leaves the file as it was


def keyed(gemm: dict) -> dict:
    """A table's GEMM section as a DeviceTable keys it (plain 4-tuples are the bf16 GemmKeys)."""
    return DeviceTable("keyed", 0, gemm).gemm


def test_fp16_activations_have_entries_of_their_own_and_else_read_their_bf16_twins(tmp_path):
    # An FP8 launch on fp16 activations (W x^T) takes other tiles than the same shape on bf16 ones; where the
    # table has none for it, the bf16 twin's tiles (tuned for that shape) beat the guess. Entries written before
    # the key had activations still read as bf16 and are written unchanged.
    path = tmp_path / "sm90-132sm.json"
    down, qkv = ("proj", 2048, 8192, True), ("proj", 3072, 2048, True)
    bf16_tiles, fp16_tiles, qkv_tiles = TileConfig(32, 256, 4, 3, 4), TileConfig(32, 256, 2, 4, 4), TileConfig(32, 128)
    tiles.write_table(path, gemm={16: {down: bf16_tiles, (*down, "fp16"): fp16_tiles, qkv: qkv_tiles}})
    lines = [line for line in path.read_text().splitlines() if '"kind"' in line]
    assert sum('"activations": "fp16"' in line for line in lines) == 1 and len(lines) == 3
    table = tiles.load_table(path, 132)
    assert table.gemm_tiles(down, 16) == table.gemm_tiles((*down, "bf16"), 16) == bf16_tiles
    assert table.gemm_tiles((*down, "fp16"), 16) == fp16_tiles
    assert table.gemm_tiles((*qkv, "fp16"), 64) == qkv_tiles  # no fp16 entry: the twin's, at the nearest rows
    other = ("proj", 4096, 8192, True, "fp16")
    assert table.gemm_tiles(other, 16) == tiles.untuned_gemm_tiles("proj", 4096, 8192, 132)


@pytest.mark.parametrize("n,k", [(2048, 1536), (1536, 1536), (1536, 8960), (2048, 1024), (1024, 4096)])
def test_untuned_projections_split_k_into_slices_that_each_hold_work(n, k):
    # K = 1536 is 6 steps of 256, so 4 slices of 2 steps would leave the last one empty
    cfg = tiles.untuned_gemm_tiles("proj", n, k, sm_count=132)
    per = -(-(-(-k // cfg.split_k)) // cfg.block_k) * cfg.block_k  # the kernel's slice width
    assert 1 < cfg.split_k <= 4 and per * (cfg.split_k - 1) < k
    assert tiles.tile_problem("proj", True, cfg) is None


def test_untuned_projections_split_k_only_while_their_tiles_leave_sms_idle():
    # 2048 outputs are 64 tiles of 32: fewer than 132 SMs, as many as 64
    assert tiles.untuned_gemm_tiles("proj", 2048, 2048, sm_count=132).split_k > 1
    assert tiles.untuned_gemm_tiles("proj", 2048, 2048, sm_count=64).split_k == 1
    assert tiles.untuned_gemm_tiles("gated", 2048, 2048, sm_count=132).split_k == 1  # gated launches never split


def test_the_attentions_programs_and_chunks_follow_the_devices_sm_count(fake_gpus):
    gpus, _ = fake_gpus
    gpus.update({0: ((8, 9), 66), 1: ((8, 9), 132)})
    small, large = torch.device("cuda", 0), torch.device("cuda", 1)
    launch = AttentionTiles()
    assert da.launch_programs(small, launch) == 2 * 66 and da.launch_programs(large, launch) == 2 * 132
    assert da.launch_programs(large, AttentionTiles(programs_per_sm=4)) == 4 * 132
    assert da.launch_programs(torch.device("cpu"), launch) == 2 * tiles.HOST_SM_COUNT
    # 16 rows x 8 kv heads are 128 programs a chunk: two chunks reach 132 programs, three 264
    assert da.chunking(16, 8, 640, 64, da.launch_programs(small, launch)) == (320, 2)
    assert da.chunking(16, 8, 640, 64, da.launch_programs(large, launch)) == (256, 3)
