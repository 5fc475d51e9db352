"""``python -m bench``: see bench/cli.py (on a core install it names the extra: bench/__init__.py)."""

from bench.cli import main

raise SystemExit(main())
