"""How a command fails: one line saying what failed, the path involved and the fix.

train.py, `python -m grpo.eval` and `python -m grpo.export` end every error in `report`: it prints
`error: ...` on one line (notes a run attached, such as where it saved, follow on the same line) and
returns the exit status. The traceback is shown only with --debug or GRPO_DEBUG=1. `describe` words
the errors of a file system (read-only, full, a file where a folder belongs, ...) with the path and
the fix; an error raised by grpo itself already says what to do and is printed as it is.

What it deliberately is not: recovery. Saving what can be saved is the run's business
(`grpo.trainer`); this module only words what happened.
"""

from __future__ import annotations

import errno
import os
import sys
import traceback

DEBUG_ENV = "GRPO_DEBUG"

# errno -> what it means for a path, and the fix
_OS_FAULTS = {
    errno.ENOSPC: ("no space left on its device", "free space there or choose another folder"),
    errno.EDQUOT: ("disk quota exceeded", "free space there or choose another folder"),
    errno.EROFS: ("read-only file system", "choose a writable folder"),
    errno.EACCES: ("permission denied", "choose a folder you can write to, or fix its permissions"),
    errno.EPERM: ("operation not permitted", "choose a folder you can write to, or fix its permissions"),
    errno.EEXIST: ("a file is in the way", "move that file, or choose another path"),
    errno.ENOTDIR: ("a file stands where a folder is needed", "move that file, or choose another path"),
    errno.EISDIR: ("a folder stands where a file is needed", "choose another path"),
    errno.ENOENT: ("no such file or folder", "check the path"),
    errno.EIO: ("input/output error", "check the disk (dmesg), then retry"),
}


def debug_requested(flag: bool = False) -> bool:
    """--debug, or GRPO_DEBUG set to anything but 0."""
    return flag or os.environ.get(DEBUG_ENV, "0") not in ("", "0")


def add_note(err: BaseException, note: str) -> None:
    """BaseException.add_note where Python has it (3.11+); the same attribute before."""
    if hasattr(err, "add_note"):
        err.add_note(note)
    else:
        err.__notes__ = [*getattr(err, "__notes__", []), note]


def first_line(text: str, limit: int = 400) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[:limit] + " ..."


def os_fault(err: OSError) -> tuple[str, str]:
    """(what happened, the fix) for an OSError, in words."""
    return _OS_FAULTS.get(err.errno, (err.strerror or first_line(str(err)) or type(err).__name__,
                                      "check the path and retry"))


def describe_os_error(err: OSError) -> str:
    """`path: what happened; fix: ...` for an OSError."""
    meaning, fix = os_fault(err)
    return f"{err.filename}: {meaning}; fix: {fix}" if err.filename is not None else f"{meaning}; fix: {fix}"


def explained_by_grpo(err: BaseException) -> bool:
    """Raised with a message written for the user: by grpo, or a ValueError/ImportError with a reason."""
    return type(err).__module__.split(".")[0] == "grpo" or isinstance(err, (ValueError, ImportError))


def describe(err: BaseException) -> str:
    """The one line for `err`, notes included, without the `error: ` prefix."""
    if isinstance(err, OSError) and not explained_by_grpo(err) and err.errno is not None:
        text = describe_os_error(err)
    elif explained_by_grpo(err) or isinstance(err, OSError):
        text = first_line(str(err)) or type(err).__name__
    else:
        text = f"{type(err).__name__}: {first_line(str(err))}"
    notes = [first_line(n) for n in getattr(err, "__notes__", [])]
    return "; ".join([text, *notes])


def report(err: BaseException, debug: bool = False, message: str | None = None, stream=None) -> int:
    """Prints the one line for `err`, or `message` in its place (the traceback first when asked);
    returns the exit status 1."""
    stream = stream or sys.stderr
    if debug_requested(debug):
        traceback.print_exception(type(err), err, err.__traceback__, file=stream)
    explained = message is not None or explained_by_grpo(err) or isinstance(err, OSError) or debug_requested(debug)
    hint = "" if explained else f" (--debug or {DEBUG_ENV}=1 shows where)"
    print(f"error: {message or describe(err)}{hint}", file=stream)
    return 1


def adapter_load_error(err: BaseException, adapter: object, model: str) -> str | None:
    """The one line for an adapter that does not load onto `model` (peft's size mismatch, an unreadable
    safetensors file); None for any other error."""
    text = str(err)
    if isinstance(err, RuntimeError) and "size mismatch" in text:
        detail = next((ln.strip() for ln in text.splitlines() if "size mismatch" in ln), "")
        return (f"--adapter {adapter} does not fit --model {model} ({first_line(detail, 240)}); fix: pass the base "
                "model the adapter was trained on (adapter_config.json names it as base_model_name_or_path)")
    if type(err).__name__ == "SafetensorError" and "deserializ" in text:
        return (f"--adapter {adapter}: adapter_model.safetensors is unreadable ({first_line(text)}); fix: use an "
                "intact copy, e.g. a checkpoint-N folder of the run")
    return None


def write_failure(err: BaseException) -> str | None:
    """Why a write failed, in words, when `err` is a failed write: an OSError, or a serializer's error
    (torch.save on a full disk says only `enforce fail at inline_container`); None for anything else."""
    text = first_line(str(err), 200)
    if isinstance(err, OSError) and err.errno is not None:
        return os_fault(err)[0]
    if "inline_container" in text or "file write failed" in text:
        return f"the write stopped short, as on a full disk: {text}"
    if type(err).__name__ == "SafetensorError" and "serializ" in text and "deserializ" not in text:
        return f"the write stopped short: {text}"
    return None
