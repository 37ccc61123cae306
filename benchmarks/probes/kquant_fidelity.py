"""How closely grpo.kquants reproduces llama.cpp's Q4_K / Q6_K blocks: the packaged Qwen2.5-Coder-1.5B
Q4_K_M GGUF (written by llama.cpp's quantizer) dequantized with gguf, re-quantized with ours.

    python benchmarks/probes/kquant_fidelity.py [--layers 0,13,27] [--rows 4096]      # CPU, ~2 minutes

The dequantized weights are exactly representable in the file's own blocks, so a re-quantizer that
makes llama.cpp's choices gives those blocks back bit for bit; a block that differs shows a different
choice of scales (the error it adds is printed beside it). The same-block share is the fidelity; the
relative error (rms(ours - file) / rms(file)) is what a different choice costs. Runs on CPU (no GPU).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    import gguf

    from grpo.kquants import BLOCK_BYTES, quantize_k
    from grpo.packaged_models import QWEN25_CODER_1_5B, gguf_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="0,13,27", help="Layers whose matrices are re-quantized.")
    parser.add_argument("--rows", type=int, default=4096, help="Rows of token_embd and output re-quantized.")
    args = parser.parse_args()
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
