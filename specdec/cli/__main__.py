"""``python -m specdec.cli``: the same as the ``specdec`` command."""

from specdec.cli import entry

entry()
