"""`python -m zerokit.bench`: the command line (zerokit.bench.cli.main)."""

import sys

from zerokit.bench.cli import main

# bench.py once ended by importing itself under its own name, so that the workers' function
# reached the ranks by reference and not by value (cloudpickle copies a __main__ function
# with its globals). Not needed any more: the workers' function lives in zerokit.bench.worker,
# an importable module, whichever file runs as __main__.
sys.exit(main())
