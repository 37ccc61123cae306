"""The decode attention Triton kernels, run by Triton's interpreter on the CPU (TRITON_INTERPRET=1);
collected only when that variable is set (tests/test_decode_gemm.py runs this folder in a subprocess)."""

from __future__ import annotations

import pytest
import torch

from grpo.kernels import decode_attention as da
from grpo.kernels.tiles import AttentionTiles

BLOCK_S = AttentionTiles().block_s  # the CPU's launch: no device table, the defaults


def cpu_chunking(rows: int, n_kv: int, seq: int) -> tuple[int, int]:
    """The chunks a launch on the CPU (the interpreter) plans."""
    return da.chunking(rows, n_kv, seq, BLOCK_S, da.launch_programs(torch.device("cpu"), AttentionTiles()))


def views(rows: int, heads: int, n_kv: int, seq: int, dim: int, seed: int):
    """q and K/V cache views inside bigger buffers (strided in row, head and position, as the engine's)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, dim, generator=g)
    k_all, v_all = torch.randn(2, rows + 1, n_kv + 1, seq + 7, dim, generator=g) * 2
    return q, k_all[:rows, :n_kv, :seq], v_all[:rows, :n_kv, :seq]


@pytest.mark.parametrize("rows,heads,n_kv,seq,dim", [(3, 8, 2, 40, 16), (2, 6, 1, 300, 32), (4, 4, 4, 130, 16),
                                                     (70, 12, 2, 200, 16)])
def test_decode_attention_matches_reference_for_every_row_length(rows, heads, n_kv, seq, dim):
    q, k, v = views(rows, heads, n_kv, seq, dim, seed=rows)
    lengths = torch.randint(1, seq + 1, (rows,), generator=torch.Generator().manual_seed(1))
    lengths[0], lengths[-1] = 1, seq  # one position, and the whole bucket
    got = da.decode_attention(q, k, v, lengths, dim**-0.5)
    torch.testing.assert_close(got, da.decode_attention_ref(q, k, v, lengths, dim**-0.5), atol=2e-5, rtol=2e-5)
    if rows * n_kv <= 16:  # (the interpreter takes seconds a launch at 70 rows)
        strided_q = q.transpose(1, 2).contiguous().transpose(1, 2)  # the same values in another layout
        assert torch.equal(da.decode_attention(strided_q, k, v, lengths, dim**-0.5), got)


def test_positions_past_a_rows_length_are_never_read():
    q, k, v = views(3, 4, 2, 260, 16, seed=0)
    lengths = torch.tensor([5, 130, 200])
    want = da.decode_attention(q, k, v, lengths, 0.25)
    for b, n in enumerate(lengths.tolist()):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    assert cpu_chunking(3, 2, 260)[1] > 1  # chunks past a row's length exist, and are skipped
    torch.testing.assert_close(da.decode_attention(q, k, v, lengths, 0.25), want, atol=0, rtol=0)


def test_chunks_fill_the_gpu_with_whole_loop_steps():
    assert da.chunking(1, 1, 4096, 64, 264) == (64, 64)  # one row, one kv head: a chunk per loop step
    assert da.chunking(16, 8, 640, 64, 264) == (256, 3)  # 128 programs a chunk: three reach 264
    assert da.chunking(256, 2, 2048, 64, 264) == (2048, 1)  # enough rows already: no combine launch
    for rows, n_kv, seq in ((3, 2, 300), (64, 2, 384), (5, 8, 64)):
        for block_s, programs in ((64, 264), (32, 100), (128, 1056)):
            chunk, chunks = da.chunking(rows, n_kv, seq, block_s, programs)
            assert chunk % block_s == 0 and (chunks - 1) * chunk < seq <= chunks * chunk


def test_native_engine_with_the_attention_kernel_gives_the_rollout_of_sdpa_attention():
    # through the modules' layer (the kernel layer with it: test_native_engine_runs_qwen3_on_the_kernels_...)
    import sys
    from pathlib import Path

    from peft import LoraConfig, get_peft_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for test_native_engine's helpers
    from grpo.config import LORA_TARGETS
    from grpo.rollout.base import Sampling
    from grpo.rollout.native import EngineTuning, NativeEngine
    from test_native_engine import PAD, PROMPTS, small_llama

    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), init_lora_weights=False)
    lora = get_peft_model(small_llama(seed=4, layers=1), config)
    sampling = Sampling(max_new_tokens=5, temperature=1.0, seed=6)

    def rollout(attention: str):  # a bucket of 64 past the longest row: the kernel reads each row to its own end
        tuning = EngineTuning(attention=attention, kv_bucket=64)
        return NativeEngine(lora, max_seq_len=80, max_batch=6, pad_id=PAD, gemm="modules", tuning=tuning).generate(
            PROMPTS, 2, sampling)

    ref, out = rollout("sdpa"), rollout("kernel")
    assert torch.equal(out.completion_ids, ref.completion_ids)
    torch.testing.assert_close(out.sampler_logp, ref.sampler_logp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows,heads,n_kv,seq,dim", [(3, 8, 2, 40, 16), (4, 4, 4, 300, 32), (4, 8, 2, 300, 32)])
def test_rope_store_attend_writes_the_tokens_kv_and_attends_as_its_reference(rows, heads, n_kv, seq, dim):
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, heads * dim, generator=g)
    k, v = torch.randn(2, rows, n_kv * dim, generator=g)
    angles = torch.rand(rows, dim // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    pos = torch.randint(0, seq, (rows,), generator=g)
    pos[0], pos[-1] = 0, seq - 1  # the first position, and the last of the bucket
    pos[1] = cpu_chunking(rows, n_kv, seq)[0] % seq  # a chunk's first: the loop reads nothing before the token
    k_all, v_all = torch.randn(2, rows + 1, n_kv + 1, seq + 7, dim, generator=g)  # views, as the engine's
    mine, ref = (k_all.clone(), v_all.clone()), (k_all.clone(), v_all.clone())
    got = da.rope_store_attend(q, k, v, cos, sin, pos, *(c[:rows, :n_kv, :seq] for c in mine), dim**-0.5)
    want = da.rope_store_attend_ref(q, k, v, cos, sin, pos, *(c[:rows, :n_kv, :seq] for c in ref), dim**-0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    for written, expected in zip(mine, ref):  # the token's K (rotated) and V, and nothing else
        torch.testing.assert_close(written, expected, atol=1e-6, rtol=0)
    assert not torch.equal(mine[0], k_all)
    assert cpu_chunking(rows, n_kv, seq)[1] > 1 or seq <= BLOCK_S  # chunks other than the token's exist


def test_a_stopped_row_reads_none_of_its_cache_and_attends_to_its_token_alone():
    # `live` False: the row's output is its token's V (as rope_store_attend_ref's), its cache unread (NaN there
    # would reach the output), its token's K/V still written; the live rows as without `live`
    rows, heads, n_kv, seq, dim = 4, 8, 2, 300, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(rows, heads * dim, generator=g)
    k, v = torch.randn(2, rows, n_kv * dim, generator=g)
    angles = torch.rand(rows, dim // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    pos = torch.tensor([250, 250, 0, 140])  # stopped rows in a later chunk than the first, and at position 0
    live = torch.tensor([True, False, True, False])
    caches = torch.randn(2, rows, n_kv, seq, dim, generator=g)
    mine, ref = caches.clone(), caches.clone()
    mine[:, ~live] = float("nan")
    got = da.rope_store_attend(q, k, v, cos, sin, pos, mine[0], mine[1], dim**-0.5, live)
    want = da.rope_store_attend_ref(q, k, v, cos, sin, pos, ref[0], ref[1], dim**-0.5, live)
    assert cpu_chunking(rows, n_kv, seq)[1] > 1  # chunks other than the token's exist, and are combined
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[~live], v[~live].view(2, n_kv, 1, dim).expand(2, n_kv, heads // n_kv, dim)
                               .reshape(2, heads, dim), atol=0, rtol=0)
    for b in (1, 3):  # the stopped rows' token K/V written at their positions
        torch.testing.assert_close(mine[:, b, :, pos[b]], ref[:, b, :, pos[b]], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="live needs"):
        da.rope_store_attend(q, k, v, cos, sin, pos, mine[0], mine[1], dim**-0.5, live.int())


def test_rope_store_attend_reads_q_k_and_v_as_column_slices_of_one_product():
    # packed.PackedGroup's stacked q/k/v GEMM hands over column slices (rows strided by every head's width):
    # read in place, they give what the same tensors give copied apart
    rows, heads, n_kv, seq, dim = 3, 8, 2, 40, 16
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(rows, (heads + 2 * n_kv) * dim, generator=g)
    q, k, v = qkv.split([heads * dim, n_kv * dim, n_kv * dim], dim=1)
    angles = torch.rand(rows, dim // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    pos = torch.tensor([0, 17, seq - 1])
    caches = torch.randn(2, rows, n_kv, seq, dim, generator=g)
    mine, apart = caches.clone(), caches.clone()
    got = da.rope_store_attend(q, k, v, cos, sin, pos, mine[0], mine[1], dim**-0.5)
    want = da.rope_store_attend(q.contiguous(), k.contiguous(), v.contiguous(), cos, sin, pos, apart[0], apart[1],
                                dim**-0.5)
    assert torch.equal(got, want) and torch.equal(mine, apart)


def test_native_engine_with_the_rotaries_in_the_attentions_launch_gives_the_kernel_layers_rollout(monkeypatch):
    # the kernel layer (decode GEMM kernels, the attention kernel) with q's and K's rotaries and the K/V write
    # inside the attention's launch, against the same layer attending with sdpa, the rotaries and write apart;
    # rows stop at different steps (a quarter of the vocabulary stops a row), and the attention then skips
    # the stopped rows' caches
    import sys
    from pathlib import Path

    from peft import LoraConfig, get_peft_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for test_native_engine's helpers
    from grpo.config import LORA_TARGETS
    from grpo.rollout.base import Sampling
    from grpo.rollout.native import EngineTuning, NativeEngine
    from test_native_engine import PAD, PROMPTS, small_llama

    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), init_lora_weights=False)
    lora = get_peft_model(small_llama(seed=5, layers=1), config)
    sampling = Sampling(max_new_tokens=4, temperature=1.0, seed=7, stop_token_ids=tuple(range(0, 1024, 4)))

    def rollout(attention: str):
        tuning = EngineTuning(attention=attention)
        engine = NativeEngine(lora, max_seq_len=16, max_batch=6, pad_id=PAD, gemm="kernels", tuning=tuning)
        return engine, engine.generate(PROMPTS, 2, sampling)

    _, ref = rollout("sdpa")
    from grpo.kernels import decode_gemm
    from grpo.rollout.native import layer as native_layer

    def apart(*args):
        raise AssertionError("the K/V write ran apart from the attention")

    live_rows = []

    def fused(*args, **kwargs):
        live_rows.append(int(args[-1].sum()))  # live, the last positional argument
        return da.rope_store_attend(*args, **kwargs)

    monkeypatch.setattr(decode_gemm, "rope_store_kv", apart)  # the fused path runs in every layer, or this fails
    monkeypatch.setattr(native_layer, "rope_store_attend", fused)
    engine, out = rollout("kernel")
    assert all(layer.attention == "kernel" for layer in engine._layers)
    lengths = ref.mask.sum(1)
    assert 0 < int(lengths.min()) < int(lengths.max())  # rows stopped at different steps
    assert 0 < min(live_rows) < max(live_rows) == len(PROMPTS) * 2  # and the attention was told which
    assert torch.equal(out.completion_ids, ref.completion_ids)
    torch.testing.assert_close(out.sampler_logp, ref.sampler_logp, atol=1e-5, rtol=0)


def test_the_attention_kernel_leaves_qwen3s_head_norms_and_rotaries_apart(monkeypatch):
    # Qwen3 normalizes each head of q and k before their rotaries: those layers keep the launches apart
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for test_native_engine's helpers
    from grpo.rollout.base import Sampling
    from grpo.rollout.native import EngineTuning, NativeEngine
    from grpo.rollout.native import layer as native_layer
    from test_native_engine import PAD, PROMPTS, small_decoder

    model = small_decoder("qwen3", seed=3, layers=1)
    sampling = Sampling(max_new_tokens=3, temperature=1.0, seed=2)

    def fused(*args):
        raise AssertionError("a Qwen3 layer took the fused path, past its head norms")

    monkeypatch.setattr(native_layer, "rope_store_attend", fused)
    engine = NativeEngine(model, max_seq_len=16, max_batch=6, pad_id=PAD, gemm="kernels",
                          tuning=EngineTuning(attention="kernel"))
    out = engine.generate(PROMPTS, 2, sampling)
    assert all(layer.attention == "kernel" for layer in engine._layers)  # asked for
    assert bool(out.mask.all()) and bool(torch.isfinite(out.sampler_logp).all())

