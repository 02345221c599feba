"""`python -m zerokit.grading.autograde`: the instructor's command (see the package docstring)."""

import sys

from . import main

sys.exit(main())
