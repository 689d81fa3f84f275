"""Parallelism on a device mesh, torch-native: DDP, FSDP2/HSDP, tensor parallel (DTensor), pipeline parallel.

``ParallelDims`` -> ``build_mesh`` -> ``parallelize(model, dims, mesh, device, ...)`` -> ``ParallelModel``.
See docs/parallelism.md.
"""

from crosstrain.parallel.dims import ParallelDims
from crosstrain.parallel.mesh import build_mesh, dp_rank_and_size
from crosstrain.parallel.model import ParallelModel, parallelize

__all__ = ["ParallelDims", "ParallelModel", "build_mesh", "dp_rank_and_size", "parallelize"]
