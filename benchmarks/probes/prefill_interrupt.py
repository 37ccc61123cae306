"""How soon a Ctrl-C stops the hf engine in a long prefill, with the prompt read in chunks and in one piece.

A second Ctrl-C raises KeyboardInterrupt from Python's signal handler, which runs only between operations:
while one long operation (the attention of a whole long prompt) runs, the signal waits. This sends SIGINT
`--after` seconds into `HFEngine.generate` on the packaged SmolLM2-135M (CPU, one torch thread) and reports
the seconds from the signal to the KeyboardInterrupt, for each `--chunk` (0: one piece).

    .venv/bin/python benchmarks/probes/prefill_interrupt.py --prompt-tokens 4096 --rows 4 --chunk 256 0
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="Tokens of the one prompt.")
    parser.add_argument("--rows", type=int, default=4, help="Completions of the prompt (rows prefilled).")
    parser.add_argument("--chunk", type=int, nargs="+", default=[256, 0], help="Prefill chunks to try (0: none).")
    parser.add_argument("--after", type=float, default=5.0, help="Seconds into generate when SIGINT comes.")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from grpo.model.packaged import packaged_model_dir
    from grpo.rollout import Sampling
    from grpo.rollout.hf import HFEngine

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(packaged_model_dir("smollm2-135m-instruct"), dtype=torch.float32)
    prompt = torch.randint(100, 40_000, (args.prompt_tokens,)).tolist()
    sampling = Sampling(max_new_tokens=4, temperature=1.0, seed=0)
    for chunk in args.chunk:
        engine = HFEngine(model, pad_id=0, prefill_chunk=chunk or 10**9)
        sent = {}
        timer = threading.Timer(args.after, lambda: (sent.setdefault("at", time.perf_counter()),
                                                     os.kill(os.getpid(), signal.SIGINT)))
        timer.start()
        start = time.perf_counter()
        try:
            engine.generate([prompt], args.rows, sampling)
            print(f"chunk {chunk or 'none'}: generate finished in {time.perf_counter() - start:.1f} s before the signal")
        except KeyboardInterrupt:
            stopped = time.perf_counter()
            print(f"chunk {chunk or 'none'}: {args.rows} x {args.prompt_tokens} prompt tokens, SIGINT at "
                  f"{sent['at'] - start:.1f} s, stopped {stopped - sent['at']:.1f} s after it", flush=True)
        finally:
            timer.cancel()


if __name__ == "__main__":
    main()
