"""Durable files: what the run writes is whole on disk or not there at all, even if the process is
killed or the disk fills mid-write.

- `write_atomically`: a small file (config.json, a repaired metrics.jsonl), written beside its place,
  flushed, renamed over it.
- `append_line`: one line appended in one write, flushed (a metrics.jsonl record); a line cut short
  is the reader's to drop.
- `fill_folder` then `publish`: a folder (a checkpoint, the adapter) filled under a temporary name,
  flushed file by file, then renamed to its final name and the rename flushed.
- `give_usual_modes`: every file of a folder readable as the user's umask allows, as a plain `open()`
  makes it (safetensors writes through a private temporary file, which leaves 0600).

What it deliberately is not: what is written, or what a failure means to the run (`grpo.run.checkpoint`
words a failed checkpoint; `grpo.run.failures` explains OS errors). It imports nothing of this project, so
that the config, the checkpoints and the evaluations all write through it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> None:
    """`path` holds `data` whole or keeps what it held: written beside it, flushed to disk, renamed over it."""
    tmp = path.with_name(f".tmp-{path.name}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # less the umask
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def append_line(path: Path, line: bytes) -> None:
    """Appends `line` to `path` (created if missing) in one write, flushed to disk before returning."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # less the umask
    try:
        written = os.write(fd, line)
        if written != len(line):  # only a full disk cuts a small write short; the next open drops it
            raise OSError(28, "No space left on device (a line was cut short)", str(path))
        os.fsync(fd)
    finally:
        os.close(fd)


def fill_folder(tmp: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` fills a fresh temporary folder, whose files get the user's usual mode and are then flushed
    to disk. On any failure (or an interrupt) the folder is removed and the error raised: nothing
    half-written is left behind."""
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        write(tmp)
        give_usual_modes(tmp)
        sync_folder(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish(tmp: Path, final: Path) -> None:
    """Renames the flushed folder `tmp` to `final` (which must not exist) and flushes the rename."""
    tmp.rename(final)
    sync_folder(final.parent, files=False)


def usual_file_mode() -> int:
    """The mode a plain `open()` gives a new file: 0666 less the process's umask (read by setting it and
    putting it straight back: the only way to read it)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def give_usual_modes(folder: Path) -> None:
    """Every file directly in `folder` gets `usual_file_mode()`: a file written through a private temporary
    file (safetensors': 0600) is then as readable as the rest, e.g. by a serving process of another user."""
    mode = usual_file_mode()
    for path in folder.iterdir():
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def sync_folder(folder: Path, files: bool = True) -> None:
    """Flush `folder`'s files and its entries to disk, so a rename after it publishes whole files."""
    if files:
        for path in folder.iterdir():
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
