"""``python -m crosstrain`` (what ``torchrun -m crosstrain`` runs)."""

import sys

from crosstrain.cli.main import main
from crosstrain.parentwatch import watch_launcher

watch_launcher()  # a worker of `crosstrain train --nproc`: exit when the launcher does
sys.exit(main())
