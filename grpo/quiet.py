"""The third-party warnings known to be harmless, hidden at their source; `train.py -v` shows them.

Each entry names the module (or logger) that emits the warning and the start of what it says, so
nothing else is hidden: a new warning from the same library, or the same words from another module,
still reaches stderr. Python warnings are filtered by category, module and message
(`warnings.filterwarnings`); the libraries that warn through `logging` get a filter on their own
logger that drops only the matching records.

`hide_known_warnings()` is called once, at the start of each command line (`train.py` and `python -m
grpo.model.packaged` after parsing their flags; `python -m grpo.eval` and `grpo.export` through
`quiet_unless_verbose`; `add_verbose_flag` gives each its -v), before those libraries are imported (torchao's
notes come when loading a GGUF imports it); importing this module changes nothing. What it deliberately is not: a blanket
filter, or a place for this project's own warnings (fix those instead).
"""

from __future__ import annotations

import logging
import re
import warnings

# (category, module, message start): Python warnings, matched as `warnings.filterwarnings` does.
HARMLESS_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    # transformers 5 renamed gradient checkpointing to activation checkpointing; the old names, which
    # peft and grpo.model.load call, keep working until v6.
    (FutureWarning, r"transformers\.modeling_utils", r"`is_gradient_checkpointing` is deprecated"),
    (FutureWarning, r"transformers\.modeling_utils", r"`gradient_checkpointing_enable` is deprecated"),
)

# (logger, message pattern): records of libraries that warn through `logging`, matched with re.search.
HARMLESS_LOG_RECORDS: tuple[tuple[str, str], ...] = (
    # torchao ships compiled kernels for other torch builds (CUDA, MX formats); it falls back without them,
    # and grpo calls none of them.
    ("torchao", r"^Failed to load .*\.so"),
    # torchao registers its enums with torch's pytree the old way: a deprecation for torchao to act on.
    ("torch.utils._pytree", r"is an Enum subclass and is now natively supported"),
    # Greedy decoding (held-out eval) sets top_k=0 explicitly so that no model default leaks into sampling;
    # transformers notes that greedy ignores it, which is the point.
    ("transformers.generation.configuration_utils", r"generation flags are not valid and may be ignored: \['top_k'\]"),
    # bitsandbytes looks for an optional 4-bit CPU kernel on the kernels hub at import (CPUs with AVX512-BF16);
    # grpo uses its 8-bit AdamW only, and offline the lookup always fails.
    ("bitsandbytes.backends.cpu.ops", r"^Failed to load CPU gemm_4bit_forward from kernels-community"),
    # ... and with the hub offline, the kernels library says first that it skips that kernel's publisher check.
    ("kernels._internals.hf_hub", r"^Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'"),
)


class DropMatching(logging.Filter):
    """A logger filter that drops the records whose message matches `pattern` and passes every other."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def hide_known_warnings() -> None:
    """Hide exactly the warnings listed above; a second call adds nothing."""
    for category, module, message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for logger_name, pattern in HARMLESS_LOG_RECORDS:
        logger = logging.getLogger(logger_name)
        if not any(isinstance(f, DropMatching) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(DropMatching(pattern))


def quiet_unless_verbose(argv: list[str]) -> None:
    """`hide_known_warnings()` unless -v/--verbose is among a command line's arguments: for a `python -m`
    entry point, before its modules import the libraries that warn (its parser comes with those modules)."""
    if not {"-v", "--verbose"} & set(argv):
        hide_known_warnings()


def add_verbose_flag(parser) -> None:
    """-v/--verbose on a command line of this project: show what `hide_known_warnings` would hide."""
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="Also show the third-party warnings hidden as harmless (grpo.quiet).")
