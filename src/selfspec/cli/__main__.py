"""``python -m selfspec.cli``: the ``selfspec`` command."""

from . import main

raise SystemExit(main())
