"""``MoELayer``: router -> (capacity) -> permute -> experts -> unpermute, plus shared experts, balancing terms
through the loop's auxiliary-loss path and per-layer metrics."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from crosstrain import kernels
from crosstrain.engine.aux_loss import add_aux_loss, add_metric, add_pooled_aux_loss, collecting
from crosstrain.plugins.moe import balance, capacity, router
from crosstrain.plugins.moe.config import MoESection
from crosstrain.plugins.moe.experts import GroupedExperts


class SharedExperts(nn.Module):
    """Always-on SwiGLU experts (DeepSeekMoE's shared experts), as one MLP of ``shared * hidden`` columns."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(kernels.swiglu(self.w1(x), self.w3(x)))

    def tp_plan(self) -> dict[str, Any]:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}


class ExpertTensorParallel(ParallelStyle):
    """The ``ParallelStyle`` of :class:`GroupedExperts`: hands the tp mesh to its ``apply_tensor_parallel``."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        module.apply_tensor_parallel(device_mesh)  # type: ignore[operator]
        return module


class MoELayer(nn.Module):
    """A Mixture-of-Experts feed-forward block: ``forward(x [B, T, D]) -> [B, T, D]``.

    The router (``router.weight [E, D]``) runs in fp32; ``expert_bias`` (aux-loss-free balancing) is a buffer
    changed only by :meth:`update_bias`. During a training forward it adds ``moe_load_balance`` and
    ``moe_z_loss`` through :func:`crosstrain.engine.aux_loss.add_aux_loss` and reports ``moe/<layer>/max_load``,
    ``mean_load``, ``drop_rate`` and ``router_entropy``.
    """

    expert_bias: torch.Tensor
    load_sum: torch.Tensor

    def __init__(self, dim: int, hidden: int, cfg: MoESection, *, layer: str = "moe", layer_id: int = 0) -> None:
        super().__init__()
        self.cfg = cfg.model_copy()
        self.layer = layer
        self.layer_id = layer_id
        self.num_experts = cfg.experts
        self.router = nn.Linear(dim, cfg.experts, bias=False)
        # read as a weight in fp32 (below), never called: a LoRA or fake-quant wrapper around it would do nothing
        self.router.forward_unused = True
        self.experts = GroupedExperts(cfg.experts, dim, hidden, layer=layer, layer_id=layer_id,
                                      timeout_s=cfg.exchange_timeout_s)
        self.shared = SharedExperts(dim, hidden * cfg.shared_experts) if cfg.shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(cfg.experts))
        # choices per expert since the last bias update (training forwards only); not checkpointed
        self.register_buffer("load_sum", torch.zeros(cfg.experts), persistent=False)

    def init_weights(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(self.router.weight.shape, generator=generator) * std)
            self.experts.init_weights(std, out_std, generator)
            if self.shared is not None:
                for lin, s in ((self.shared.w1, std), (self.shared.w3, std), (self.shared.w2, out_std)):
                    lin.weight.copy_(torch.randn(lin.weight.shape, generator=generator) * s)

    def tp_plan(self) -> dict[str, Any]:
        """Routed experts sharded over their hidden size (outputs all-reduced); the router stays replicated
        (every tp rank routes the same tokens the same way); shared experts bring their own plan."""
        return {"experts": ExpertTensorParallel()}

    # -- forward ----------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        n, e, k = flat.shape[0], self.num_experts, cfg.top_k
        route_in = router.jitter(flat.float(), cfg.jitter) if (self.training and cfg.jitter) else flat.float()
        logits = route_in @ self.router.weight.float().t()
        scores = router.router_scores(logits, cfg.router)
        ids, weights = router.top_k(scores, k, self.expert_bias if cfg.bias_update_rate else None, cfg.renormalize)
        if torch.compiler.is_exporting():  # ONNX / torch.export: no data-dependent shapes
            return self._export_forward(flat, ids, weights).reshape(shape).to(x.dtype)
        probs = router.routing_distribution(scores, cfg.router)

        if cfg.capacity_factor > 0:
            cap = capacity.expert_capacity(n, k, e, cfg.capacity_factor)
            keep = capacity.capacity_keep(ids, weights, e, cap, cfg.drop_policy)
            slots = torch.where(keep, ids, torch.full_like(ids, e))  # dropped copies go to a last, unused bucket
            permuted, order, counts = kernels.moe_permute(flat, slots, e + 1)
            kept = int(keep.sum())
            out = self.experts(permuted[:kept], counts[:e], cap)
            out = torch.cat([out, out.new_zeros(permuted.shape[0] - kept, out.shape[-1])])
            combine = weights * keep
        else:
            cap, kept = -1, n * k
            permuted, order, counts = kernels.moe_permute(flat, ids, e)
            out = self.experts(permuted, counts)
            combine = weights
        y = kernels.moe_unpermute(out, order, combine.to(out.dtype))
        if self.shared is not None:
            y = y + self.shared(flat)
        if self.training:
            # the balancing terms run in every training-mode forward, so activation checkpointing's recompute
            # saves the same tensors as the original forward; add_aux_loss is a no-op outside the loop's forward
            self._balance(logits, probs, ids, shape)
            if collecting():  # not again in a recompute
                self._metrics(ids, probs, kept, n * k)
        return y.reshape(shape).to(x.dtype)

    def _export_forward(self, flat: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The dropless function with static shapes, for export: every expert on every token, weighted by the
        ``[N, E]`` combine matrix (zero off the top-k). ``E`` times the expert FLOPs; capacity is not applied."""
        combine = torch.zeros(flat.shape[0], self.num_experts, dtype=flat.dtype, device=flat.device)
        combine = combine.scatter(1, ids, weights.to(flat.dtype))
        ex = self.experts
        w1, w3, w2 = (w.to(flat.dtype) for w in (ex.w1, ex.w3, ex.w2))
        h = kernels.swiglu(torch.einsum("nd,edh->neh", flat, w1), torch.einsum("nd,edh->neh", flat, w3))
        y = torch.einsum("neh,ehd,ne->nd", h, w2, combine)
        return y + self.shared(flat) if self.shared is not None else y

    def _balance(self, logits: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor, shape: torch.Size) -> None:
        cfg = self.cfg
        if cfg.aux_loss_coeff > 0 and cfg.aux_loss != "none":
            term: torch.Tensor | None
            if cfg.aux_loss == "sequence" and len(shape) == 3:
                b, t = shape[0], shape[1]
                term = balance.sequence_aux_loss(probs.view(b, t, -1), ids.view(b, t, -1), cfg.aux_loss_coeff)
            elif cfg.aux_loss == "pooled":
                # computed in every grad-recording forward (so a recompute saves what the forward saved); added
                # only inside the loop's forward, finished once per forward with one all-reduce of the counts
                if torch.is_grad_enabled():
                    add_pooled_aux_loss("moe_load_balance", balance.pooled_stats(probs, ids),
                                        functools.partial(balance.pooled_aux_loss, coeff=cfg.aux_loss_coeff))
                term = None
            elif cfg.aux_loss == "global":
                # Only where gradients are recorded (a training forward or its recompute, which every rank runs):
                # under no_grad (rollout generation, whose ranks may stop after different numbers of tokens) the
                # term trains nothing, and an all-reduce would wait for ranks that never join it.
                counts = balance.global_counts(ids, self.num_experts) if torch.is_grad_enabled() else None
                term = balance.switch_aux_loss(probs, ids, cfg.aux_loss_coeff, counts=counts)
            else:
                term = balance.switch_aux_loss(probs, ids, cfg.aux_loss_coeff)
            if term is not None:
                add_aux_loss("moe_load_balance", term)
        if cfg.z_loss_coeff > 0:
            add_aux_loss("moe_z_loss", balance.z_loss(logits, cfg.z_loss_coeff))
        if cfg.bias_update_rate > 0 and collecting():
            self.load_sum += balance.expert_counts(ids.detach(), self.num_experts).to(self.load_sum.device)

    def _metrics(self, ids: torch.Tensor, probs: torch.Tensor, kept: int, total: int) -> None:
        counts = balance.expert_counts(ids.detach(), self.num_experts)
        prefix = f"moe/{self.layer_id}"
        add_metric(f"{prefix}/max_load", counts.max())
        add_metric(f"{prefix}/mean_load", counts.mean())
        add_metric(f"{prefix}/drop_rate", 1.0 - kept / max(total, 1))
        add_metric(f"{prefix}/router_entropy", balance.router_entropy(probs.detach()))

    # -- aux-loss-free balancing ------------------------------------------------------------------------------
    @torch.no_grad()
    def update_bias(self, group: Any = None) -> None:
        """``expert_bias += rate * sign(mean - load)`` with the loads since the last call summed over ``group``
        (the world by default), so every rank applies the same update; then the loads restart from zero."""
        loads = self.load_sum.clone()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(loads, group=group)
        if float(loads.sum()) > 0:
            self.expert_bias.copy_(balance.bias_update(self.expert_bias, loads, self.cfg.bias_update_rate))
        self.load_sum.zero_()
