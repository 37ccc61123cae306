"""One live run per output folder: the claim file `.claim` in it, locked by the run that holds the folder.

    claim = RunClaim.take(out)   # raises FolderInUse if a live process holds `out`
    ...                          # the run
    claim.release()

The lock is a POSIX record lock (`fcntl.lockf`) on `.claim`, so the kernel drops it when its process ends,
however it ends (kill -9, a crash, a reboot): a claim can be stale only in its text, never in its lock. The
text says who holds it (pid, host, start time, command) so that a refused run can name the other process in
its one line. A run that ends cleanly empties the file; one that finds text in a file it could lock knows
the run before it ended without releasing it (killed, or lost with its machine) and takes over, with a note.

What it deliberately is not: a queue (a second run is refused, never made to wait), or a check of what the
folder holds (`grpo.run.checkpoint.claim_output_dir` decides whether a folder may take a run; this only keeps two
live runs from deciding it at once).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

CLAIM_FILE = ".claim"


class FolderInUse(ValueError):
    """Another live process holds the folder's claim."""


class RunClaim:
    """The held claim of one folder; `note` says whose stale claim it took over, if any."""

    def __init__(self, folder: Path, fd: int, note: str | None, made_folder: bool):
        self.folder, self.note = folder, note
        self._fd: int | None = fd
        self._made_folder = made_folder

    @classmethod
    def take(cls, folder: Path) -> "RunClaim | None":
        """Claim `folder` (made if missing) for this process. FolderInUse if a live process holds it; None
        where no claim file can be made (a file in the folder's place, no write permission): the writes
        that follow fail then, and explain why."""
        made_folder = not folder.exists()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / CLAIM_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _read_holder(fd)
            os.close(fd)
            if err.errno not in (errno.EACCES, errno.EAGAIN):
                return None  # a file system without locks (some network mounts): nothing to guard with
            raise FolderInUse(f"--output-dir {folder} is in use by another run: {describe_holder(holder)}; "
                              f"fix: wait for it to end (or stop it), or pick another --output-dir") from None
        previous = _read_holder(fd)
        note = None
        if previous and previous.get("pid") != os.getpid():
            note = (f"--output-dir {folder}: the run that held it ({describe_holder(previous)}) ended without "
                    "releasing it (killed, or its machine stopped); taken over")
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_this_process()) + "\n").encode(), 0)
        return cls(folder, fd, note, made_folder)

    def moved_to(self, folder: Path) -> "RunClaim":
        """After --overwrite renamed the folder (this claim went with it): claim the new `folder`, and leave
        the old one released, as a finished run leaves it."""
        claim = RunClaim.take(folder)
        if claim is None:
            raise FolderInUse(f"--output-dir {folder}: its claim file cannot be made after --overwrite moved the "
                              "old run aside")
        claim.note = self.note  # the stale claim taken over was this folder's, under its old name
        self.release()
        return claim

    def release(self) -> None:
        """The run is over: the file emptied (a clean end), the lock dropped. Safe to call twice."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        finally:
            os.close(self._fd)  # drops the lock
            self._fd = None

    def abandon(self) -> None:
        """The run was refused before writing anything: released, and the folder removed if this claim made
        it and nothing else is in it."""
        self.release()
        if self._made_folder:
            try:
                (self.folder / CLAIM_FILE).unlink()
                self.folder.rmdir()
            except OSError:
                pass


def describe_holder(holder: dict | None) -> str:
    """'pid 123 on host, started YYYY-MM-DD HH:MM:SS UTC: train.py --seed 1' (what is known of it)."""
    if not holder:
        return "a process that is starting now"
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("started", 0)))
    command = f": {holder['command']}" if holder.get("command") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {started}{command}"


def _this_process() -> dict:
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else ""
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "command": command[:200]}


def _read_holder(fd: int) -> dict | None:
    """The claim's text, or None when empty (released, or its holder has not written it yet) or unreadable."""
    try:
        text = os.pread(fd, 4096, 0).decode()
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None
