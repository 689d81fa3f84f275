"""The layout x feature matrix: every combination of recipe, layout, optimizer, kernels, packing, MoE, LoRA,
precision and gradient accumulation either trains the same logged losses as its 1-process reference or is
refused in one line before any work (``crosstrain.config.rules``).

``python -m crosstrain.testing.matrix`` runs a pairwise cover; ``--full`` every admitted combination of the
factors the rules read, the others pairwise (docs/parallelism.md says exactly what each covers).
"""

from crosstrain.testing.matrix.cli import run_matrix
from crosstrain.testing.matrix.factors import FACTORS, Cell
from crosstrain.testing.matrix.plan import plan, refusal

__all__ = ["FACTORS", "Cell", "plan", "refusal", "run_matrix"]
