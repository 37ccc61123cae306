"""What a run leaves behind and how it stops: the output folder's claim (`claim`), checkpoints and resuming
(`checkpoint`), writes that never leave half a file (`durable`), signals (`signals`), the metrics log and the
progress line (`log`), the plot of a run (`plots`) and the one-line failure messages (`failures`).

What it deliberately is not: the loop (`grpo.trainer`) or the step (`grpo.step`); they call into this.
"""
