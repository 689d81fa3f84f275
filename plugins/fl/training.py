"""A client's local training: crosstrain's loop with the ``fl_client`` recipe instance (``Trainer(recipe=...)``).

The recipe is ``lm`` on this client's shard of the data (contiguous shard ``id`` of ``fl.clients``), starting
from the server's global weights. Every ``fl.local_steps`` optimizer steps its ``after_optimizer_step`` hands the
update (local - global, flat float32) to the server, records the round as an ``fl_round`` event (the run's
events.jsonl and every metrics sink) and loads the next round's global weights; when the server has finished it
asks the loop to stop. With ``fl.fedprox_mu`` the loss gains FedProx's proximal term mu/2 * ||w - w_global||^2
(Li et al. 2020, "Federated Optimization in Heterogeneous Networks", eq. 2) as the auxiliary loss ``aux/fedprox``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from crosstrain.engine.aux_loss import add_aux_loss
from crosstrain.engine.recipe import MicroBatchLoss, ModelSpec
from crosstrain.errors import ConfigError
from crosstrain.plugins.fl.client import FLClient, Round
from crosstrain.plugins.fl.globalstate import Layout
from crosstrain.recipes.lm import LMRecipe, build_model

RECIPE = "fl_client"


class Shard:
    """Samples ``[start, stop)`` of a recipe dataset: one client's contiguous part of the data."""

    def __init__(self, base: Any, index: int, count: int) -> None:
        n = len(base)
        self.base, self.start, self.stop = base, index * n // count, (index + 1) * n // count
        if self.stop <= self.start:
            raise ConfigError(f"the data has {n} samples, too few to give each of fl.clients={count} one; lower "
                              "fl.clients or train.seq_len")
        self.vocab_size = getattr(base, "vocab_size", None)

    def __len__(self) -> int:
        return self.stop - self.start

    def batch(self, indices: Any) -> Any:
        return self.base.batch(np.asarray(indices, dtype=np.int64) + self.start)


def proximal_term(params: list[torch.Tensor], anchor: list[torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx: mu/2 * sum ||w - w_global||^2 over the parameters (Li et al. 2020, eq. 2)."""
    return 0.5 * mu * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor, strict=True))  # type: ignore[return-value]


class FLClientRecipe(LMRecipe):
    """``lm`` on this client's shard, from the global weights, exchanging updates every ``fl.local_steps``."""

    name = RECIPE
    supports_pipeline = False

    def __init__(self, client: FLClient, clients: int) -> None:
        super().__init__()
        self.client, self.clients = client, clients
        self.round: Round | None = None
        self.layout: Layout | None = None
        self.model: nn.Module | None = None
        self.anchor: list[torch.Tensor] = []
        self.losses: list[torch.Tensor] = []
        self.rounds_done = 0
        self.mu = 0.0
        self.weight = 1.0
        self.last_loss = float("nan")

    def build_models(self, context: Any) -> dict[str, ModelSpec]:
        if context.world_size != 1:
            raise ConfigError("an FL client trains in one process; drop --nproc (run more clients instead)")
        model = build_model(context.config)
        self.layout = Layout(model)
        self.round = self.client.next_round()
        if self.round is None:
            raise ConfigError("the FL server has no round left to run (fl.rounds reached); raise fl.rounds")
        if self.round.global_vec.shape[0] != self.layout.dim:
            raise ConfigError(f"the server's model has {self.round.global_vec.shape[0]} parameters, this client's "
                              f"{self.layout.dim}; use the same model.* config on both")
        self._load(model)
        self.model = model
        return {"model": ModelSpec(model, source="fl global model")}

    def build_dataset(self, context: Any) -> Shard:
        base = super().build_dataset(context)
        assert self.client.client_id is not None
        if not 0 <= self.client.client_id < self.clients:
            raise ConfigError(f"client id {self.client.client_id} is outside 0..fl.clients-1={self.clients - 1}")
        shard = Shard(base, self.client.client_id, self.clients)
        self.weight = float(len(shard))  # FedAvg weights clients by their number of samples
        return shard

    def _load(self, model: nn.Module) -> None:
        assert self.layout is not None and self.round is not None
        self.layout.load_into(model, self.round.global_vec)
        self.mu = float(self.round.meta.get("fedprox_mu", 0.0))
        self.anchor = [p.detach().clone() for p in model.parameters()] if self.mu > 0 else []

    def loss(self, models: Mapping[str, nn.Module], batch: Any) -> MicroBatchLoss:
        out = super().loss(models, batch)
        self.losses.append(out.loss.detach())  # this round's micro-batch losses, sent along with the update
        if self.mu > 0:
            add_aux_loss("fedprox", proximal_term(list(models["model"].parameters()), self.anchor, self.mu))
        return out

    def after_optimizer_step(self, context: Any, step: int) -> None:
        """At the end of a round's local steps, exchange with the server and record the round (``fl_round``).

        The loss sent along is the mean training loss of the round's micro-batches.
        """
        assert self.round is not None and self.layout is not None and self.model is not None
        local_steps = int(self.round.meta["local_steps"])
        if step % local_steps:
            return
        update = self.layout.flatten(self.model) - self.round.global_vec
        mean_loss = float(torch.stack(self.losses).float().mean()) if self.losses else float("nan")
        self.losses = []
        record = {"round": self.round.round + 1, "loss": mean_loss if np.isfinite(mean_loss) else None,
                  "update_norm": float(np.linalg.norm(update)), "weight": self.weight}
        nxt = self.client.exchange(self.round, update, weight=self.weight, loss=mean_loss)
        self.rounds_done += 1
        self.last_loss = mean_loss
        context.emit_event("fl_round", **record)
        if nxt is None:
            if step < context.config.train.steps:  # stop early (the server resumed, or this client joined late)
                context.request_stop("fl: the server has finished its rounds")
            return
        self.round = nxt
        self._load(self.model)


def run_client(config: Any, run_dir: Path, client: FLClient) -> dict[str, Any]:
    """Train as an FL client until the server finishes; writes summary.json to ``run_dir`` (the training run, with
    each round's ``fl_round`` event in its events.jsonl, under ``run_dir/train``)."""
    from crosstrain.checkpoint.atomic import atomic_write
    from crosstrain.engine.trainer import Trainer
    from crosstrain.plugins.fl.server import check_modes, fl_section

    fl = fl_section(config)
    check_modes(fl)
    cfg = config.model_copy(deep=True)
    cfg.train.recipe = RECIPE
    cfg.train.steps = fl.rounds * fl.local_steps  # the LR schedule spans every round
    cfg.eval.every = 0
    cfg.checkpoint.every = cfg.checkpoint.every_minutes = 0
    cfg.checkpoint.final = False  # the server checkpoints the global model; a client keeps nothing
    cfg.checkpoint.resume = "never"
    run_dir.mkdir(parents=True, exist_ok=True)
    recipe = FLClientRecipe(client, fl.clients)
    try:
        Trainer(cfg, run_dir / "train", recipe=recipe).fit()
    finally:
        client.channel.close()
    summary = {"client": client.client_id, "rounds": recipe.rounds_done, "clients": fl.clients, "secure": fl.secure,
               "final_loss": recipe.last_loss if np.isfinite(recipe.last_loss) else None,
               "dropped_clients": [client.client_id] if client.dropped_rounds else [],
               "dropped_rounds": client.dropped_rounds, "samples": recipe.weight}
    atomic_write(run_dir / "summary.json", json.dumps(summary, indent=1).encode())
    return summary
