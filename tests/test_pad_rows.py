"""Rows of different lengths into one padded tensor (grpo.rollout.base.pad_rows), the one way every engine
and the step build them: lists or a tensor's rows, right- or left-padded, empty rows and a set width."""

from __future__ import annotations

import torch

from grpo.rollout.base import pad_rows


def test_lists_are_right_padded_to_the_longest_row_or_a_set_width():
    assert pad_rows([[1, 2], [3], []], 0, dtype=torch.long).tolist() == [[1, 2], [3, 0], [0, 0]]
    got = pad_rows([[0.5], [-1.0, -2.0]], 0.0, width=3, dtype=torch.float32)
    assert got.dtype == torch.float32 and got.tolist() == [[0.5, 0.0, 0.0], [-1.0, -2.0, 0.0]]


def test_left_padding_puts_each_row_at_the_right_as_generation_prompts_need():
    assert pad_rows([[1, 2], [3], []], 9, dtype=torch.long, left=True).tolist() == [[1, 2], [9, 3], [9, 9]]


def test_a_tensors_rows_widen_keeping_dtype_and_values():
    mask = torch.tensor([[True, False], [True, True]])
    got = pad_rows(mask, False, width=4)
    assert got.dtype == torch.bool and got.tolist() == [[True, False, False, False], [True, True, False, False]]
    assert pad_rows(torch.tensor([[7]]), 0, width=3, left=True).tolist() == [[0, 0, 7]]
