"""The subcommands of ``ampguard``: one module each (see :mod:`ampguard.cli`)."""
