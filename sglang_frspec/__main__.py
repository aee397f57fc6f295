"""``python -m sglang_frspec`` runs the ``sglang-frspec`` command line."""

import sys

from sglang_frspec.cli import main

sys.exit(main())
