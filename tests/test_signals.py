"""Stopping on a signal (grpo/run/signals.py): a first Ctrl-C, SIGTERM or SIGHUP asks the loop to stop, a second
stops at once with its number, and the old handlers come back."""

from __future__ import annotations

import io
import os
import signal

import pytest

from grpo.run.signals import StopOnSignal, Stopped


def test_the_first_ctrl_c_asks_to_stop_the_second_stops_at_once_and_restore_puts_the_old_handler_back():
    from rich.console import Console

    before = signal.getsignal(signal.SIGINT)
    stop = StopOnSignal(Console(file=io.StringIO()))
    try:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_ask_to_stop_as_ctrl_c_does_and_a_second_signal_stops_with_its_number(signum):
    from rich.console import Console

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    text = io.StringIO()
    stop = StopOnSignal(Console(file=text))
    try:
        os.kill(os.getpid(), signum)
        assert stop.requested and stop.signum == signum
        assert f"{signal.Signals(signum).name}: finishing this step" in text.getvalue()
        with pytest.raises(Stopped) as second:
            os.kill(os.getpid(), signal.SIGINT)
        assert second.value.signum == signal.SIGINT and isinstance(second.value, KeyboardInterrupt)
    finally:
        stop.restore()
    assert {s: signal.getsignal(s) for s in before} == before
