"""Where a completion stops: the model's EOS ids, the first stop token or the end of the first stop
sequence (token ids), and the token-id sequences that spell a text stop string.

What it deliberately is not: sampling. Engines call `first_stop_index` on ids; the tokenizer is used
here only to turn text and configs into ids, never inside an engine."""

from __future__ import annotations


def stop_token_ids(tokenizer, generation_config) -> tuple[int, ...]:
    """EOS ids of the tokenizer and of the model's generation config (Llama 3 instruct has three)."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return tuple(sorted(i for i in ids if i is not None))


def first_stop_index(row: list[int], stop_token_ids, stop_sequences) -> int | None:
    """Index of the last token of the first stop in `row` (that token is kept), or None."""
    stop_ids = set(stop_token_ids)
    by_last: dict[int, list[tuple[int, ...]]] = {}  # a sequence can only end on its own last token
    for seq in stop_sequences:
        if seq:
            by_last.setdefault(seq[-1], []).append(tuple(seq))
    for t, token in enumerate(row):
        if token in stop_ids:
            return t
        for seq in by_last.get(token, ()):
            k = len(seq)
            if t + 1 >= k and tuple(row[t + 1 - k:t + 1]) == seq:
                return t
    return None


# BPE merges a string's first character with what precedes it ("</" vs " </" vs "></") and its last
# with what follows ("OLUTION", ">" vs "OLUTION", ">\n"), so one string has several token spellings;
# each seen in these surroundings becomes a stop sequence.
_BEFORE = ("", " ", "\n", "0", "a", ".", ">", ")", "=", ":")
_AFTER = ("", "\n", "\n\n", " ", ".", ",", ")", '"', "<")


def stop_string_sequences(tokenizer, strings) -> tuple[tuple[int, ...], ...]:
    """Token-id stop sequences for text stop strings: every spelling seen between `_BEFORE` and `_AFTER`.

    A sequence is the shortest run of tokens whose text holds the string, ending at the token that
    completes it; that token may carry a character or two past the string (">\n"), which then stay in
    the completion. Engines match token ids on the device, so a spelling outside these surroundings
    is missed (that row runs on to EOS or the length limit).
    """
    sequences: list[tuple[int, ...]] = []
    for text in strings:
        if not text:
            raise ValueError("stop strings: an empty string would stop every row at once; remove it")
        found = 0
        for before in _BEFORE:
            for after in _AFTER:
                ids = tokenizer(before + text + after, add_special_tokens=False)["input_ids"]
                end = next((j for j in range(1, len(ids) + 1) if text in tokenizer.decode(ids[:j])), None)
                if end is None:
                    continue
                start = max(i for i in range(end) if text in tokenizer.decode(ids[i:end]))
                seq = tuple(ids[start:end])
                found += 1
                if seq not in sequences:
                    sequences.append(seq)
        if not found:
            raise ValueError(f"stop string {text!r}: this tokenizer decodes no token run back to it; "
                             "pick a string the tokenizer can spell")
    return tuple(sequences)
