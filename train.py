"""GRPO with rsLoRA adapters: `python train.py --help` lists every flag, grouped, with its value.

Exit status: 0 done; 1 an error, told in one line (`--debug` or GRPO_DEBUG=1 adds the traceback);
2 a flag refused; 128 + the signal after Ctrl-C (130), SIGTERM (143) or SIGHUP (129), having saved.
"""

import signal
import sys


def main(argv: list[str] | None = None) -> int:
    # grpo is imported here, not at the top: a Python without the environment (e.g. `python3 train.py`) gets one
    # line saying which Python to use, not a traceback.
    try:
        from grpo.config import parse_command_line
        from grpo.quiet import hide_known_warnings
    except ModuleNotFoundError as missing:
        return outside_the_environment(missing)
    cfg, verbose = parse_command_line(argv)
    if not verbose:  # before the libraries that warn are imported
        hide_known_warnings()
    if cfg.engine == "unsloth":
        import_unsloth_first()
    try:
        from grpo.run.checkpoint import RunFinished
        from grpo.run.failures import report
        from grpo.trainer import train
    except ModuleNotFoundError as missing:
        return outside_the_environment(missing)
    try:
        train(cfg)
    except RunFinished as done:  # --resume of a run that has no step left: said, and not an error
        print(f"nothing to do: {done}")
        return 0
    except KeyboardInterrupt as stop:  # grpo.run.signals.Stopped carries the signal; a plain one is Ctrl-C's
        return 128 + getattr(stop, "signum", signal.SIGINT)
    except Exception as err:
        return report(err, cfg.debug)
    return 0


def import_unsloth_first() -> None:
    """Unsloth patches transformers and peft as it is imported, so it comes before them (the trainer imports both).
    If it cannot be imported, the engine's own import of it says why, as a one-line error."""
    try:
        import unsloth  # noqa: F401
    except Exception:
        pass


def outside_the_environment(missing: ModuleNotFoundError) -> int:
    print(f"error: {missing.name} is not installed in this Python ({sys.executable}); fix: run ./dev train "
          "(it sets up .venv first), or .venv/bin/python train.py", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
