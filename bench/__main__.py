"""``python -m bench``: see bench/cli.py."""

from bench import MissingBenchExtra

try:
    from bench.cli import main
except MissingBenchExtra as e:  # a core install: say which extra to install, not a traceback
    raise SystemExit(f"python -m bench: {e}") from None

raise SystemExit(main())
