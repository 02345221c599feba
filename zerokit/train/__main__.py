"""python -m zerokit.train, torchrun -m zerokit.train: the capstone's script (zerokit/train/__init__.py)."""

import sys

from zerokit.train import main

sys.exit(main())
