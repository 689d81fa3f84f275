"""``python -m crosstrain.testing.matrix [--full] [--out DIR]`` (see crosstrain.testing.matrix)."""

import sys

from crosstrain.testing.matrix.cli import main

sys.exit(main())
