"""How many decode steps episodes take on the native engine, by the block of steps between the host's looks
(`EngineTuning.turn_block`), against turns played in lockstep.

A row that stops waits for the rest of its block and one more before its reply goes in (`turns.py`), and each
reply token is a decode step of its row; smaller blocks wait less and have the host read more often. This counts steps, not seconds, so it runs anywhere (a CPU in a minute): a tiny
random Llama whose greedy text does not repeat, `--rows` rows sampled at temperature 1, turns that end at one
token id in `--turn-tokens` (turns of about that many tokens, each row's its own), replies of `--reply` tokens,
`--budget` tokens a row, up to `--max-turns` turns. For each block size: the decode steps in place, the model
tokens, and the share of row-steps that wrote a model token. `lockstep`: the same episodes' turns played as the
reference plays them, each turn one `generate` as long as its longest row's turn (the steps a turn-synchronous
engine would take).

    PYTHONPATH=$PWD python3 benchmarks/probes/turn_blocks.py --out DIR [--blocks 4 8 16] [--turn-tokens 64 128]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import Recorder, add_out_argument  # noqa: E402

from grpo.agents.episodes import ResentTurns  # noqa: E402
from grpo.rollout.base import Sampling  # noqa: E402
from grpo.rollout.native import EngineTuning, NativeEngine  # noqa: E402

VOCAB, PAD = 1024, 4


def lively_llama(seed: int = 0):
    """A tiny random Llama with weights large enough that its text does not settle on one token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      initializer_range=0.3, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


class _Generate:
    """An engine's `generate` alone: the reference way, each turn's contexts re-sent."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompt_ids, n, sampling):
        return self.engine.generate(prompt_ids, n, sampling)


def play(turns, args) -> tuple[int, list[int]]:
    """(model tokens, each `ended()` call's longest turn): every row answered with the same reply while it has
    room and turns."""
    tokens, used, count, longest = 0, {}, {}, []
    ended = turns.ended()
    while ended:
        longest.append(max(len(e.ids) for e in ended))
        go_on = {}
        for e in ended:
            tokens += len(e.ids)
            used[e.row] = used.get(e.row, 0) + len(e.ids)
            count[e.row] = count.get(e.row, 0) + 1
            if e.finished and count[e.row] < args.max_turns and used[e.row] + args.reply < args.budget:
                go_on[e.row] = [900] * args.reply
                used[e.row] += args.reply
        turns.continue_rows(go_on)
        ended = turns.ended()
    return tokens, longest


def main() -> None:
    parser = argparse.ArgumentParser(prog="turn_blocks.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="Rows: prompts x 4 generations.")
    parser.add_argument("--budget", type=int, default=256, help="Tokens a row, turns and replies together.")
    parser.add_argument("--reply", type=int, default=12, help="Tokens of each reply.")
    parser.add_argument("--max-turns", type=int, default=8, help="Turns an episode at most.")
    parser.add_argument("--turn-tokens", type=int, nargs="+", default=[64, 128], help="Turns' mean lengths.")
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16], help="turn_block values.")
    add_out_argument(parser)
    args = parser.parse_args()
    rec = Recorder("turn_blocks", args.out)
    model = lively_llama()
    rng = random.Random(0)
    prompts = [[rng.randrange(5, VOCAB) for _ in range(16)] for _ in range(args.rows // 4)]
    for turn_tokens in args.turn_tokens:
        sampling = Sampling(max_new_tokens=args.budget, temperature=1.0, seed=1,
                            stop_token_ids=tuple(range(3, VOCAB, turn_tokens)))
        for block in args.blocks:
            engine = NativeEngine(model, max_seq_len=16 + 2 * args.budget, max_batch=args.rows, pad_id=PAD,
                                  tuning=EngineTuning(kv_bucket=64, turn_block=block))
            with engine.turns(prompts, 4, sampling) as turns:
                tokens, _ = play(turns, args)
                steps = turns.timings["decode_steps"]
            rec.record("in_place", turn_tokens=turn_tokens, turn_block=block, decode_steps=steps,
                       model_tokens=tokens, row_steps_used=tokens / (args.rows * steps))
        with ResentTurns(_Generate(engine), prompts, 4, sampling) as turns:
            tokens, longest = play(turns, args)
        rec.record("lockstep", turn_tokens=turn_tokens, decode_steps=sum(longest), model_tokens=tokens,
                   row_steps_used=tokens / (args.rows * sum(longest)))


if __name__ == "__main__":
    main()
