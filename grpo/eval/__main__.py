"""`python -m grpo.eval --help`: held-out accuracy of a checkpoint, with or without an adapter."""

import sys

from grpo.quiet import quiet_unless_verbose

quiet_unless_verbose(sys.argv[1:])  # before grpo.eval.cli imports the libraries that warn

from grpo.eval.cli import main  # noqa: E402

raise SystemExit(main())
