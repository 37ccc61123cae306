"""`python -m grpo.export --help`: merge an adapter into its base and write GGUF files."""

import sys

from grpo.quiet import quiet_unless_verbose

quiet_unless_verbose(sys.argv[1:])  # before grpo.export.merge imports the libraries that warn

from grpo.export.merge import main  # noqa: E402

raise SystemExit(main())
