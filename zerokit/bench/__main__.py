"""`python -m zerokit.bench`: the command line (zerokit.bench.main)."""

import sys

from zerokit.bench import main

# No importable-twin trick needed here: `python -m zerokit.bench` imports the package
# zerokit.bench before running this file, so the workers' function lives in an importable
# module and cloudpickle sends it by reference, not by value with its globals.
sys.exit(main())
