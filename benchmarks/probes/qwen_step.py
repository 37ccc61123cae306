"""One recorded step of the qwen1.5b-gsm8k preset, the lengths the probes that price the preset share (not a probe).

8 prompts x 8 completions (GENERATIONS): each row's prompt tokens and completion tokens, as a real step of the
preset had them on GSM8K (`train_pass.py` trains on them, `native_engine.py --plan qwen` stops its rows at them).
"""

QWEN_PROMPTS = [90] * 8 + [121] * 8 + [99] * 8 + [175] * 8 + [168] * 8 + [124] * 8 + [129] * 8 + [122] * 8
QWEN_COMPLETIONS = [160, 179, 209, 150, 146, 111, 210, 153, 168, 233, 245, 354, 245, 201, 209, 197, 159, 146, 348,
                    146, 111, 145, 129, 108, 372, 364, 217, 200, 264, 384, 301, 196, 290, 384, 342, 356, 384, 384,
                    246, 208, 240, 367, 260, 384, 226, 197, 266, 184, 241, 260, 228, 221, 149, 235, 287, 232, 384,
                    384, 353, 384, 384, 352, 384, 384]
GENERATIONS = 8
