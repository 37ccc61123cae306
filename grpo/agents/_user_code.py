"""User code named as `path/to/file.py:name` or `module:name`, imported as `--reward` imports it
(`grpo.rewards`), with one line for a spec without both parts or a module that does not import."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from grpo.rewards import _file_module, _module


def split_spec(spec: str, what: str, form: str, example: str) -> tuple[str, str]:
    """`spec` -> (module or file, what follows the last colon), both non-empty."""
    module_name, sep, names = spec.rpartition(":")
    if not sep or not module_name or not names.strip():
        raise ValueError(f"{what} {spec!r}: expected {form}; fix: name the file and what it defines, "
                         f"as in {example}")
    return module_name, names


def import_user_module(spec: str, what: str, module_name: str, form: str) -> ModuleType:
    """The module `module_name` (a `.py` path or a module name), or one line naming it and its error."""
    try:
        return _file_module(Path(module_name)) if module_name.endswith(".py") else _module(module_name)
    except Exception as err:  # any failure while importing user code is reported the same way
        raise ValueError(f"{what} {spec!r}: cannot import {module_name!r} ({type(err).__name__}: "
                         f"{first_line(err)}); fix: run from the folder that holds it, put it on PYTHONPATH "
                         f"or give {form}") from None


def first_line(err: BaseException) -> str:
    """An exception's message cut to its first line, so that the error it ends in stays one line."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
