"""How closely grpo.export.kquants reproduces llama.cpp's Q4_K / Q6_K blocks: the packaged Qwen2.5-Coder-1.5B
Q4_K_M GGUF (written by llama.cpp's quantizer) dequantized with gguf, re-quantized with ours.

    python benchmarks/probes/kquant_fidelity.py [--layers 0,13,27] [--rows 4096]      # CPU, ~2 minutes

The dequantized weights are exactly representable in the file's own blocks, so a re-quantizer that
makes llama.cpp's choices gives those blocks back bit for bit; a block that differs shows a different
choice of scales (the error it adds is printed beside it). The same-block share is the fidelity; the
relative error (rms(ours - file) / rms(file)) is what a different choice costs. Runs on CPU (no GPU).

    python benchmarks/probes/kquant_fidelity.py --survival [--rel-delta 0.001,0.003,0.01,0.03]   # CPU, <1 minute

`--survival` asks what a k-quant keeps of a fine-tune: a random rank-32 change of a given size (relative
rms) is added to weights that already lie on a k-quant grid (the packaged Qwen's, dequantized from its
Q4_K_M file, as training starts from them) and to weights that do not (SmolLM2-135M's bf16 down_proj),
and each sum is re-quantized (Q4_0 and Q8_0, whose scales are not searched, as controls).
`kept` = <Q(w + delta) - Q(w), delta> / <delta, delta>: 1 keeps the change on average, 0 snaps it back
onto the base's codes; `moved` is the share of weights whose value changed.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def survival(rel_deltas: list[float], rows: int) -> None:
    """What Q4_K, Q5_K and Q6_K keep of a small rank-32 change, on and off a k-quant grid (see above)."""
    import gguf
    from safetensors import safe_open

    from grpo.export.kquants import BLOCK_BYTES, quantize_k
    from grpo.model.load import resolve_model_dir
    from grpo.model.packaged import QWEN25_CODER_1_5B, gguf_path

    bases = {}
    for tensor in gguf.GGUFReader(gguf_path(QWEN25_CODER_1_5B)).tensors:
        if tensor.name in ("blk.13.attn_q.weight", "blk.13.ffn_up.weight"):  # Q4_K in the file
            raw = np.asarray(tensor.data)[:rows]
            bases[f"qwen {tensor.name} (on its Q4_K grid)"] = gguf.quants.dequantize(raw, tensor.tensor_type)
    with safe_open(next(resolve_model_dir("smollm2-135m-instruct").glob("*.safetensors")), framework="pt") as f:
        down = f.get_tensor("model.layers.15.mlp.down_proj.weight").float().numpy()  # 1536 columns: whole blocks
        bases["smollm2 layers.15.down_proj (bf16, off any grid)"] = down[:rows]
    rng = np.random.default_rng(0)
    for label, w in bases.items():
        change = rng.standard_normal((w.shape[0], 32)) @ rng.standard_normal((32, w.shape[1]))
        change = (change / np.sqrt(np.mean(change ** 2)) * np.sqrt(np.mean(w ** 2))).astype(np.float32)
        for name in ("Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q8_0"):  # the last two: gguf's, scales without a search
            qtype = gguf.GGMLQuantizationType[name]
            quantize = quantize_k if name in BLOCK_BYTES else gguf.quants.quantize
            before = gguf.quants.dequantize(quantize(w, qtype), qtype)
            for rel in rel_deltas:
                delta = change * np.float32(rel)
                after = gguf.quants.dequantize(quantize(w + delta, qtype), qtype)
                kept = float(np.sum((after - before) * delta) / np.sum(delta * delta))
                print(json.dumps({"base": label, "type": qtype.name, "rel_delta": rel, "kept": round(kept, 3),
                                  "moved": round(float(np.mean(after != before)), 4)}), flush=True)


def main() -> None:
    import gguf

    from grpo.export.kquants import BLOCK_BYTES, quantize_k
    from grpo.model.packaged import QWEN25_CODER_1_5B, gguf_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="0,13,27", help="Layers whose matrices are re-quantized.")
    parser.add_argument("--rows", type=int, default=4096, help="Rows of token_embd and output re-quantized "
                        "(with --survival: rows of each tensor, 1536 at most).")
    parser.add_argument("--survival", action="store_true",
                        help="Instead: what each k-quant keeps of a small change, on and off a k-quant grid.")
    parser.add_argument("--rel-delta", default="0.001,0.003,0.01,0.03",
                        help="With --survival: sizes of the change, rms relative to the weights' rms.")
    args = parser.parse_args()
    if args.survival:
        return survival([float(x) for x in args.rel_delta.split(",")], min(args.rows, 1536))
    layers = {int(x) for x in args.layers.split(",")}
    reader = gguf.GGUFReader(gguf_path(QWEN25_CODER_1_5B))
    rows = []
    for tensor in reader.tensors:
        qtype = tensor.tensor_type
        parts = tensor.name.split(".")
        wanted = (parts[0] == "blk" and int(parts[1]) in layers) or parts[0] in ("token_embd", "output")
        if qtype.name not in BLOCK_BYTES or not wanted:
            continue
        raw = np.asarray(tensor.data)[:args.rows] if parts[0] in ("token_embd", "output") else np.asarray(tensor.data)
        weights = gguf.quants.dequantize(raw, qtype)
        start = time.perf_counter()
        ours = quantize_k(weights, qtype)
        seconds = time.perf_counter() - start
        size = BLOCK_BYTES[qtype.name]
        same = np.all(ours.reshape(-1, size) == raw.reshape(-1, size), axis=1)
        back = gguf.quants.dequantize(ours, qtype)
        rel = float(np.sqrt(np.mean((back - weights) ** 2) / np.mean(weights ** 2)))
        rows.append({"tensor": tensor.name, "type": qtype.name, "blocks": int(same.size),
                     "same_blocks": round(float(same.mean()), 4), "rel_rms_error": round(rel, 5),
                     "mweights_per_s": round(weights.size / seconds / 1e6, 2)})
        print(json.dumps(rows[-1]), flush=True)
    for name in ("Q4_K", "Q6_K"):
        sel = [r for r in rows if r["type"] == name]
        blocks = sum(r["blocks"] for r in sel)
        same = sum(r["same_blocks"] * r["blocks"] for r in sel) / max(blocks, 1)
        print(json.dumps({"type": name, "tensors": len(sel), "blocks": blocks, "same_blocks": round(same, 4)}))


if __name__ == "__main__":
    main()
