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


# Characters a stop string is tokenized after: BPE merges a string's first token with what precedes
# it ("</" vs " </" vs "></"), so one string has several token spellings; each becomes a stop sequence.
_CONTEXTS = ("", " ", "\n", "0", "a", ".", ">", ")", "=", ":")


def stop_string_sequences(tokenizer, strings) -> tuple[tuple[int, ...], ...]:
    """Token-id stop sequences for text stop strings, one per spelling seen after `_CONTEXTS`.

    Each sequence is the shortest token suffix of `context + string` whose text contains the string,
    so a completion that ends with it ends with the string. Engines match token ids on the device; a
    spelling outside these contexts is missed (the row runs on to EOS or the length limit).
    """
    sequences: list[tuple[int, ...]] = []
    for text in strings:
        if not text:
            raise ValueError("stop strings: an empty string would stop every row at once; remove it")
        for context in _CONTEXTS:
            ids = tokenizer(context + text, add_special_tokens=False)["input_ids"]
            for start in range(len(ids) - 1, -1, -1):
                if text in tokenizer.decode(ids[start:]):
                    seq = tuple(ids[start:])
                    if seq not in sequences:
                        sequences.append(seq)
                    break
    return tuple(sequences)
