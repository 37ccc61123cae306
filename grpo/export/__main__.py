"""`python -m grpo.export --help`: merge an adapter into its base and write GGUF files."""

from grpo.export.merge import main

raise SystemExit(main())
