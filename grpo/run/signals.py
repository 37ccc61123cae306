"""Stopping on a signal: the first Ctrl-C, SIGTERM or SIGHUP lets the step in flight finish and the run
save before it stops (`StopOnSignal` sets a flag the loop reads); a second one stops at once (`Stopped`).

What it deliberately is not: the stop itself. `grpo.trainer.run` reads the flag after each step, saves
and raises `Stopped`; train.py turns it into the exit status 128 + the signal.
"""

from __future__ import annotations

import signal
import threading
from typing import Any


class Stopped(KeyboardInterrupt):
    """The run stopped on a signal; a command exits with 128 + `signum` (130 for Ctrl-C, 143 for SIGTERM)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class StopOnSignal:
    """The first Ctrl-C, SIGTERM or SIGHUP asks the loop to finish the step in flight, save and stop;
    a second one raises `Stopped` at once.

    Schedulers (Slurm, Kubernetes), `timeout` and a closed terminal send SIGTERM or SIGHUP rather than
    Ctrl-C's SIGINT; all three mean the same here. Finishing the step keeps a checkpoint exact:
    resuming from it continues as if never stopped. Only the main thread can own the handlers;
    elsewhere the signals keep their default behaviour.
    """

    def __init__(self, console):
        self.requested = False
        self.signum: int | None = None  # the first signal
        self.console = console
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise Stopped(signum)
        self.requested = True
        self.signum = signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        try:  # after SIGHUP the terminal may be gone: the message is not worth an error here
            self.console.print(f"[bold yellow]{name}[/]: finishing this step, then saving (again to stop now)")
        except OSError:
            pass

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
