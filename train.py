"""GRPO with rsLoRA adapters: `python train.py --help` lists every flag, grouped, with its default."""

import sys

from grpo.config import parse_args


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
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
