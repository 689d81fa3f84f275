"""``python -m crosstrain`` (what ``torchrun -m crosstrain`` runs)."""

import sys

from crosstrain.cli.main import main

sys.exit(main())
