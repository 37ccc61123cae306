"""Where a completion stops: the first stop token or the end of the first stop sequence (token ids)."""

from __future__ import annotations


def first_stop_index(row: list[int], stop_token_ids, stop_sequences) -> int | None:
    """Index of the last token of the first stop in `row` (that token is kept), or None."""
    stop_ids = set(stop_token_ids)
    for t, token in enumerate(row):
        if token in stop_ids:
            return t
        for seq in stop_sequences:
            k = len(seq)
            if k and t + 1 >= k and tuple(row[t + 1 - k:t + 1]) == tuple(seq):
                return t
    return None
