"""Triton's interpreter, made to patch triton.language once a launch and to skip the integer-overflow checks that
only a debug build asserts (imported by conftest.py where TRITON_INTERPRET=1, before the kernels run).

The interpreter swaps triton.language's builtins for its own at each launch, for the launch's whole run,
and again at every call of a @triton.jit helper inside the kernel (`_dot`, `rotated`, ...):
`inspect.getmembers` over four modules, about a millisecond each time, and a third of these tests' time
(profiled on the engine tests, triton 3.9). Nothing restores what a helper's call patched until the launch
ends, so here only a helper's first call in a launch patches (the modules its own globals name, such as
triton.language.core for the standard library's); outside a launch, or on a triton without these
internals, nothing changes. A helper left unpatched would fail loudly: the builtins raise outside the
interpreter.
"""

from __future__ import annotations

import functools

try:
    from triton.runtime import interpreter
except ImportError:  # no triton: every test here skips or fails on its own
    interpreter = None

if interpreter is not None and hasattr(interpreter, "GridExecutor") and hasattr(interpreter, "InterpretedFunction"):
    _patched: set | None = None  # inside a launch: the helpers whose modules it has patched
    _launch = interpreter.GridExecutor.__call__
    _device_call = interpreter.InterpretedFunction.__call__

    @functools.wraps(_launch)
    def _launch_patching_once(self, *args, **kwargs):
        global _patched
        outer, _patched = _patched, set()
        try:
            return _launch(self, *args, **kwargs)
        finally:
            _patched = outer

    @functools.wraps(_device_call)
    def _helper_call(self, *args, **kwargs):
        if _patched is None or self.fn not in _patched:  # the first call in a launch patches its modules
            if _patched is not None:
                _patched.add(self.fn)
            return _device_call(self, *args, **kwargs)
        try:  # the device call's own body, without its _patch_lang
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = _launch_patching_once
    interpreter.InterpretedFunction.__call__ = _helper_call

# Integer +, - and * in a kernel also compute an overflow check (each operand cast to int64, two compares) for a
# device_assert that only a debug build keeps: the interpreter builds without debug, so it dropped every check it
# had computed (a quarter of these tests' time, triton 3.9). Off, as a GPU build without debug compiles.
if interpreter is not None and hasattr(interpreter, "interpreter_builder"):
    import dataclasses

    _options = interpreter.interpreter_builder.options
    if not _options.debug and getattr(_options, "sanitize_overflow", False):
        interpreter.interpreter_builder.options = dataclasses.replace(_options, sanitize_overflow=False)
