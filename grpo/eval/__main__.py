"""`python -m grpo.eval --help`: held-out accuracy of a checkpoint, with or without an adapter."""

import sys

from grpo.quiet import quiet_unless_verbose

quiet_unless_verbose(sys.argv[1:])  # before grpo.eval.cli imports the libraries that warn

try:  # the libraries take seconds to import: Ctrl-C then is one line too, as during the evaluation
    from grpo.eval.cli import main  # noqa: E402
except KeyboardInterrupt:
    print("interrupted while loading: nothing evaluated", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
