"""State-dict adapter of Mixtral and Qwen3-MoE checkpoints: the GPT's names for everything but the MoE blocks, and
per-expert HF tensors <-> the stacked expert weights of :class:`~crosstrain.plugins.moe.experts.GroupedExperts`.

HF (what ``save_pretrained`` writes in transformers 5.24, which fuses the experts only in memory):
``model.layers.{i}.block_sparse_moe.experts.{e}.w1|w3|w2.weight`` (Mixtral; ``mlp.`` is read too, transformers 5's
in-memory name) or ``model.layers.{i}.mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`` (Qwen3-MoE), ``[hidden,
dim]`` / ``[dim, hidden]`` nn.Linear weights, and the router ``...gate.weight [E, dim]``. The fused in-memory form
(``experts.gate_up_proj [E, 2 hidden, dim]``, ``experts.down_proj [E, dim, hidden]``) is read as well. crosstrain:
``layers.{i}.feed_forward.experts.w1|w3 [E, dim, hidden]``, ``w2 [E, hidden, dim]`` (transposes, exact), and
``feed_forward.router.weight``. Tensors stream one at a time in both directions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from crosstrain.errors import ConfigError
from crosstrain.models.gpt import GPTConfig
from crosstrain.models.hf.adapter import StateDictAdapter

#: HF expert projection -> crosstrain weight, per model_type
_PROJ = {"mixtral": {"w1": "w1", "w3": "w3", "w2": "w2"},
         "qwen3_moe": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}}
_BLOCK = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp"}
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$")
_HF_FUSED = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)$")
_HF_ROUTER = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight$")
_CT_MOE = re.compile(r"^layers\.(\d+)\.feed_forward\.(router\.weight|experts\.w[123]|expert_bias)$")


@dataclass(frozen=True)
class MoEAdapter(StateDictAdapter):
    """The adapter of ``family`` (``mixtral`` or ``qwen3_moe``); see the module docstring for the names."""

    def gpt_config(self, hf: dict[str, Any], where: str) -> GPTConfig:
        from crosstrain.plugins.moe.hf_config import gpt_config

        return gpt_config(hf, where)

    def prepare(self, model: nn.Module, hf: dict[str, Any]) -> None:
        """The checkpoint's MoE layers in place of the GPT's dense MLPs (their weights are copied next)."""
        from crosstrain.plugins.moe.config import MoESection
        from crosstrain.plugins.moe.hf_config import moe_fields
        from crosstrain.plugins.moe.transform import to_moe

        to_moe(model, MoESection(**moe_fields(hf)))

    # -- names ------------------------------------------------------------------------------------------------
    def to_hf(self, name: str) -> str:
        m = _CT_MOE.match(name)
        if m is None:
            return super().to_hf(name)
        block = f"model.layers.{m.group(1)}.{_BLOCK[self.family]}"
        if m.group(2) == "router.weight":
            return f"{block}.gate.weight"
        if m.group(2) == "expert_bias":  # no HF tensor (see to_hf_tensors): a name for export's grouping only
            return f"{block}.expert_bias"
        return f"{block}.experts.0.{self._proj(m.group(2))}.weight"  # the first of the per-expert tensors

    def _proj(self, weight: str) -> str:
        """The HF projection of ``experts.w1|w3|w2``."""
        return {ours: theirs for theirs, ours in _PROJ[self.family].items()}[weight.split(".")[1]]

    def import_tensor(self, hf_name: str, tensor: torch.Tensor,
                      shapes: Mapping[str, Sequence[int]]) -> list[tuple[str, Any, torch.Tensor]]:
        prefix = "layers.{}.feed_forward"
        m = _HF_EXPERT.match(hf_name)
        if m:
            proj = _PROJ[self.family].get(m.group(3))
            if proj is None:
                raise KeyError(f"{hf_name!r} is not a {self.family} weight crosstrain knows")
            return [(f"{prefix.format(m.group(1))}.experts.{proj}", int(m.group(2)), tensor.t())]
        m = _HF_FUSED.match(hf_name)
        if m:
            base = f"{prefix.format(m.group(1))}.experts"
            if m.group(2) == "down_proj":  # [E, dim, hidden]
                return [(f"{base}.w2", None, tensor.transpose(1, 2))]
            gate, up = tensor.chunk(2, dim=1)  # [E, 2 hidden, dim]: gate rows first (transformers' chunk order)
            return [(f"{base}.w1", None, gate.transpose(1, 2)), (f"{base}.w3", None, up.transpose(1, 2))]
        m = _HF_ROUTER.match(hf_name)
        if m:
            return [(f"{prefix.format(m.group(1))}.router.weight", None, tensor)]
        return super().import_tensor(hf_name, tensor, shapes)

    def to_hf_tensors(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stacked experts as ``E`` per-expert tensors, the router as ``gate``; the expert bias must be zero."""
        out: dict[str, torch.Tensor] = {}
        rest = {}
        for name, tensor in tensors.items():
            m = _CT_MOE.match(name)
            if m is None:
                rest[name] = tensor
            elif m.group(2) == "expert_bias":  # aux-loss-free balancing's bias: the HF routers have none
                if torch.count_nonzero(tensor):
                    raise ConfigError(f"{name} is not zero (moe.bias_update_rate moved it), and {self.family} "
                                      "routers have no expert bias; export a run trained with moe.bias_update_rate=0")
            elif m.group(2) == "router.weight":
                out[self.to_hf(name)] = tensor
            else:
                block = f"model.layers.{m.group(1)}.{_BLOCK[self.family]}.experts"
                proj = self._proj(m.group(2))
                out.update({f"{block}.{e}.{proj}.weight": tensor[e].t().contiguous() for e in range(tensor.shape[0])})
        return {**super().to_hf_tensors(rest), **out} if rest else out

    def hf_config(self, cfg: GPTConfig, *, base: dict[str, Any] | None, dtype: str, eos_id: int | None,
                  shapes: Mapping[str, Sequence[int]]) -> dict[str, Any]:
        """The imported ``config.json`` (``base``) with the shape of what is exported; the experts' count, size
        and blocks come from the tensors and must agree with it."""
        from crosstrain.plugins.moe.config import MoESection
        from crosstrain.plugins.moe.hf_config import hf_config, moe_fields
        from crosstrain.plugins.moe.transform import is_moe_block

        if base is None or base.get("model_type") != self.family:
            raise ConfigError(f"exporting an MoE model as {self.family} needs the {self.family} config.json it was "
                              "imported from (model.init_from); it is gone or another model_type")
        sec = MoESection(**moe_fields(base))
        moe = sorted(int(k.split(".")[1]) for k in shapes if k.endswith("feed_forward.experts.w1"))
        want = [i for i in range(cfg.n_layers) if is_moe_block(i, sec.every, sec.dense_layers)]
        experts, expert_dim = tuple(shapes[f"layers.{moe[0]}.feed_forward.experts.w1"])[::2] if moe else (0, 0)
        if moe != want or (experts, expert_dim) != (sec.experts, sec.expert_dim):
            raise ConfigError(f"the model's MoE blocks {moe} ({experts} experts of {expert_dim}) differ from the "
                              f"{self.family} config.json it was imported from ({want}, {sec.experts} of "
                              f"{sec.expert_dim}); export the model the run trained")
        return hf_config(cfg, sec, model_type=self.family, base=base, dtype=dtype, eos_id=eos_id)


ADAPTERS: dict[str, StateDictAdapter] = {name: MoEAdapter(name) for name in _PROJ}
