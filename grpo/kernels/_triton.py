"""Whether triton is installed, looked up once for every kernel module (a sys.path walk, not per call)."""

from __future__ import annotations

import functools
import importlib.util


@functools.lru_cache(maxsize=None)
def have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None
