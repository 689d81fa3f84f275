"""Parallelism on a device mesh, torch-native: DDP, FSDP2/HSDP, tensor parallel (DTensor), pipeline parallel,
and expert parallel (the mesh's ``ep`` dim, the :class:`ExpertParallel` protocol, a differentiable all-to-all).

``ParallelDims`` -> ``build_mesh`` -> ``parallelize(model, dims, mesh, device, ...)`` -> ``ParallelModel``.
See docs/parallelism.md.
"""

from crosstrain.parallel.all_to_all import all_to_all_autograd, all_to_all_uneven_autograd, exchange_splits
from crosstrain.parallel.batch_stats import DataParallelStats, apply_data_parallel
from crosstrain.parallel.dims import ParallelDims
from crosstrain.parallel.ep import ExpertParallel, apply_ep, check_expert_model
from crosstrain.parallel.local import local_tensor
from crosstrain.parallel.mesh import build_mesh, dp_group, dp_mesh, dp_rank_and_size, ep_mesh, fsdp_mesh
from crosstrain.parallel.model import LossReduction, ParallelModel, next_token_loss, parallelize
from crosstrain.parallel.plan import register_parallel_plan

__all__ = [
    "DataParallelStats",
    "ExpertParallel",
    "LossReduction",
    "ParallelDims",
    "ParallelModel",
    "all_to_all_autograd",
    "all_to_all_uneven_autograd",
    "apply_data_parallel",
    "apply_ep",
    "build_mesh",
    "check_expert_model",
    "dp_group",
    "dp_mesh",
    "dp_rank_and_size",
    "ep_mesh",
    "exchange_splits",
    "fsdp_mesh",
    "local_tensor",
    "next_token_loss",
    "parallelize",
    "register_parallel_plan",
]
