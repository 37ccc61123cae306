"""Held-out evaluation: accuracy (strict and lenient) and format, measured apart (`accuracy`, what the trainer
calls), a checkpoint measured from the command line (`cli`, `python -m grpo.eval`), and two evaluations compared
problem by problem (`compare`, `python -m grpo.eval.compare`).
"""
