"""``python -m ampguard``: see :mod:`ampguard.cli`."""

from ampguard.cli import main

raise SystemExit(main())
