"""``python -m secateur ...`` (torchrun: ``torchrun --nproc-per-node N -m secateur prune ...``): the CLI."""

import sys

from secateur.cli import main

sys.exit(main())
