"""MoE layer throughput on this machine: crosstrain's dropless layer vs a per-expert Python loop and vs a padded
capacity-factor einsum dispatch, side by side, at 8 experts, top-2, forward + backward.

- ``dropless``: :class:`crosstrain.plugins.moe.MoELayer` with ``capacity_factor = 0`` (sort/permute, grouped matmuls
  through the kernel registry, unpermute).
- ``loop``: the DeepSpeed-MoE approach (``sharded_moe.py`` + ``experts.py``): one-hot dispatch/combine
  tensors ``[tokens, experts, capacity]`` built by einsum, then a Python loop running one expert module per
  ``[capacity, dim]`` chunk, here with ``drop_tokens=False`` (capacity = the largest expert load) so it computes the
  same function as the dropless layer.
- ``padded``: GShard's dispatch at ``capacity_factor = 1.25``: the same einsums in and out, one batched matmul over
  ``[experts, capacity, dim]``.
- ``index_loop`` (for reference, not a target): Hugging Face Mixtral's loop, which gathers each expert's tokens by
  index instead of padding (as strong as the dropless layer on a CPU, where both run one GEMM per expert).

All use the same router and expert weights. Each is timed in alternating rounds (so machine noise hits all
alike); the figure per variant is the median round. Last line: JSON with ``dropless_vs_loop``,
``dropless_vs_padded`` and ``dropless_vs_index_loop`` (tokens/s ratios).

    python benchmarks/moe.py [--tokens 2048] [--dim 64] [--hidden 96] [--rounds 15]   (the tiny GPT's MoE shape)
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from _timing import alternate, seconds
from torch import nn

from crosstrain.plugins.moe import capacity, router
from crosstrain.plugins.moe.config import MoESection
from crosstrain.plugins.moe.layer import MoELayer

EXPERTS, TOP_K = 8, 2


def _expert_modules(layer: MoELayer) -> nn.ModuleList:
    """One ``w1/w3/w2`` ``nn.Linear`` module per expert, sharing the layer's weights' values."""
    ex = layer.experts
    experts = nn.ModuleList()
    for e in range(EXPERTS):
        mlp = nn.ModuleDict({"w1": nn.Linear(1, 1, bias=False), "w3": nn.Linear(1, 1, bias=False),
                             "w2": nn.Linear(1, 1, bias=False)})
        for name in ("w1", "w3", "w2"):
            mlp[name].weight = nn.Parameter(getattr(ex, name).detach()[e].t().contiguous())
        experts.append(mlp)
    return experts


def _mlp(mlp: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    return mlp["w2"](F.silu(mlp["w1"](rows)) * mlp["w3"](rows))


class IndexLoopMoE(nn.Module):
    """Hugging Face ``MixtralSparseMoeBlock``: per expert, gather its tokens by index, run it, index_add back."""

    def __init__(self, layer: MoELayer) -> None:
        super().__init__()
        self.router = layer.router
        self.experts = _expert_modules(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = router.router_scores(x.float() @ self.router.weight.float().t(), "softmax")
        ids, weights = router.top_k(scores, TOP_K)
        out = torch.zeros_like(x)
        for e, mlp in enumerate(self.experts):
            token, slot = torch.where(ids == e)
            rows = x[token]
            y = _mlp(mlp, rows)
            out.index_add_(0, token, y * weights[token, slot, None])
        return out


class PaddedMoE(nn.Module):
    """GShard's padded dispatch: ``[N, E, C]`` one-hot dispatch/combine tensors and einsums. ``factor`` > 0: capacity
    ``ceil(N k / E * factor)`` and one batched matmul; ``factor`` = 0 with ``experts`` given: DeepSpeed-MoE with
    ``drop_tokens=False`` (capacity = the largest load) and a Python loop over the expert modules."""

    def __init__(self, layer: MoELayer, factor: float, experts: nn.ModuleList | None = None) -> None:
        super().__init__()
        self.router = layer.router
        self.experts = layer.experts
        self.loop = experts
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        scores = router.router_scores(x.float() @ self.router.weight.float().t(), "softmax")
        ids, weights = router.top_k(scores, TOP_K)
        if self.factor > 0:
            cap = capacity.expert_capacity(n, TOP_K, EXPERTS, self.factor)
        else:
            cap = int(torch.bincount(ids.reshape(-1), minlength=EXPERTS).max())
        keep = capacity.capacity_keep(ids, weights, EXPERTS, cap, "position")
        # each kept choice's slot inside its expert's buffer: its rank among the expert's kept choices
        onehot = F.one_hot(ids, EXPERTS) * keep[..., None]  # [N, k, E]
        flat = onehot.transpose(0, 1).reshape(-1, EXPERTS)  # k-major priority, as capacity_keep
        slot = (torch.cumsum(flat, 0) - 1).view(TOP_K, n, EXPERTS).transpose(0, 1)  # [N, k, E]
        slot_of = (slot * onehot).sum(-1).clamp(0, cap - 1)  # [N, k]
        place = F.one_hot(slot_of, cap).to(x.dtype) * keep[..., None]  # [N, k, C]
        dispatch = torch.einsum("nke,nkc->nec", onehot.to(x.dtype), place)
        combine = torch.einsum("nke,nkc->nec", onehot.to(x.dtype) * weights[..., None], place)
        inp = torch.einsum("nec,nd->ecd", dispatch, x)
        if self.loop is not None:  # DeepSpeed-MoE experts.py: one expert module per chunk
            out = torch.stack([_mlp(mlp, chunk) for mlp, chunk in zip(self.loop, inp.unbind(0), strict=True)])
        else:
            ex = self.experts
            out = torch.bmm(F.silu(torch.bmm(inp, ex.w1)) * torch.bmm(inp, ex.w3), ex.w2)
        return torch.einsum("ecd,nec->nd", out, combine)


def _step(module: nn.Module, x: torch.Tensor, up: torch.Tensor) -> None:
    out = module(x)
    (out * up).sum().backward()
    module.zero_grad(set_to_none=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=3, help="forward+backward calls per round")
    args = parser.parse_args()
    torch.manual_seed(0)
    layer = MoELayer(args.dim, args.hidden, MoESection(experts=EXPERTS, top_k=TOP_K))
    layer.init_weights(0.02, 0.02, torch.Generator().manual_seed(0))
    variants = {"dropless": layer, "loop": PaddedMoE(layer, 0.0, _expert_modules(layer)),
                "padded": PaddedMoE(layer, 1.25), "index_loop": IndexLoopMoE(layer)}
    x = torch.randn(args.tokens, args.dim, requires_grad=True)
    up = torch.randn(args.tokens, args.dim)
    with torch.no_grad():  # same function: the loops equal the layer; padded drops what exceeds its capacity
        for name in ("loop", "index_loop"):
            assert torch.allclose(variants[name](x), layer(x[None])[0], atol=1e-5), name
    for module in variants.values():
        _step(module, x, up)  # warm up
    inputs = {name: (x[None], up[None]) if name == "dropless" else (x, up) for name in variants}
    times = alternate(list(variants), args.rounds,
                      lambda name, _: seconds(lambda: _step(variants[name], *inputs[name]), args.iters))
    tps = {name: args.tokens / statistics.median(ts) for name, ts in times.items()}
    for name, value in tps.items():
        print(f"{name:9s} {value:12,.0f} tokens/s (forward+backward, median of {args.rounds} rounds)")
    result = {
        "experts": EXPERTS, "top_k": TOP_K, "tokens": args.tokens, "dim": args.dim, "hidden": args.hidden,
        "threads": torch.get_num_threads(), "tokens_per_s": {k: round(v) for k, v in tps.items()},
        "dropless_vs_loop": round(tps["dropless"] / tps["loop"], 3),
        "dropless_vs_padded": round(tps["dropless"] / tps["padded"], 3),
        "dropless_vs_index_loop": round(tps["dropless"] / tps["index_loop"], 3),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
