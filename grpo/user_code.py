"""User code named on the command line as `path/to/file.py:name` or `module:name` (`--reward`, and the agents'
tools and environments): the spec split, the module imported, and one line naming the spec for what fails.

A file is run once, as a module of its own (a second load, as when the command line checks a reward before the
run loads it, gets the same module); a module name is looked for where Python looks, then in the current folder.
What it deliberately is not: checking what the names stand for (each caller checks its own kind).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from grpo.run.failures import first_line


def split_spec(spec: str, what: str, form: str, example: str) -> tuple[str, str]:
    """`spec` -> (module or file, what follows the last colon), both non-empty; `what` names the flag."""
    module_name, sep, names = spec.rpartition(":")
    if not sep or not module_name or not names.strip():
        raise ValueError(f"{what} {spec!r}: expected {form}; fix: name the file and what it defines, "
                         f"as in {example}")
    return module_name, names


def import_user_module(spec: str, what: str, module_name: str, form: str) -> ModuleType:
    """The module `module_name` (a `.py` path or a module name), or one line naming the spec and its error."""
    try:
        return import_file(Path(module_name)) if module_name.endswith(".py") else import_module(module_name)
    except Exception as err:  # any failure while importing user code is reported the same way
        raise ValueError(f"{what} {spec!r}: cannot import {module_name!r} ({type(err).__name__}: "
                         f"{first_line(str(err)) or type(err).__name__}); fix: run from the folder that holds it, put "
                         f"it on PYTHONPATH or give {form}") from None


def import_module(name: str) -> ModuleType:
    """`name` imported, with the current folder searched last: train.py's own folder is on the path, and
    the user's (where `--reward my_rewards:f` points) otherwise is not."""
    here = os.getcwd()
    if here not in sys.path:
        sys.path.append(here)
    return importlib.import_module(name)


def import_file(path: Path) -> ModuleType:
    """The module of `path/to/file.py`, run once."""
    if not path.is_file():
        raise FileNotFoundError(f"no file {path}")
    name = f"grpo_user_{path.stem}"
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "")).resolve() == path.resolve():
        return loaded
    file_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    sys.modules[name] = module
    return module
