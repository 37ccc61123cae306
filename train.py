"""GRPO with rsLoRA adapters: `python train.py --help` lists every flag, grouped, with its value."""

import sys

from grpo.config import parse_command_line


def main(argv: list[str] | None = None) -> int:
    cfg, verbose = parse_command_line(argv)
    if not verbose:  # before the libraries that warn are imported
        from grpo.quiet import hide_known_warnings

        hide_known_warnings()
    from grpo.rewards import RewardError  # heavy imports after --help and flag errors
    from grpo.trainer import NonFiniteLoss, train

    try:
        train(cfg)
    except KeyboardInterrupt:
        return 130
    except (FileNotFoundError, ValueError, ImportError, NonFiniteLoss, RewardError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
