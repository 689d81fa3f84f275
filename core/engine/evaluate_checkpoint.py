"""``crosstrain eval``: the eval loss of a saved checkpoint, under any layout, writing nothing.

The run's own config (``config.toml`` next to its ``checkpoints/``) rebuilds the recipe's models on the
current layout; the checkpoint's trainable models are loaded through the backend's checkpointer (DCP
reshards any saved layout onto this one) and evaluated exactly as the training loop evaluates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from crosstrain.config import Config
from crosstrain.errors import CheckpointError, ConfigError


def evaluate_checkpoint(config: Config, step_dir: Path, verified: bool = False,
                        predictions: bool = False) -> dict[str, Any]:
    """Evaluate ``step_dir``'s weights on ``config``'s validation data (all ranks call); returns the figures
    (the same on every rank; ``rank`` says whose). ``verified``: its checksums were just checked (the resolver
    picked it among a run's checkpoints), so they are not read again. ``predictions`` (one process): also the
    recipe's per-sample predictions of the evaluated samples, as ``"predictions"`` (``Recipe.eval_predictions``)."""
    from crosstrain.engine.run import build_run

    _check_verified(step_dir, verified)
    run = build_run(config, for_eval=True)
    try:
        if run.eval is None:
            raise ConfigError(
                "this run's data has no validation part; pass --data TOKEN_FILE (or set data.val_fraction > 0)"
            )
        held_out = run.eval
        step = _load_weights(run, step_dir)
        results = run.evaluate()
        if predictions:
            from crosstrain.engine.evaluate import eval_predictions

            results["predictions"] = eval_predictions(run.recipe, run.models, run.primary, held_out.dataset,
                                                      batch_size=held_out.batch_size,
                                                      max_batches=held_out.max_batches, device=run.device)
    finally:
        run.close()
    perplexity = {"perplexity": results["eval/perplexity"]} if "eval/perplexity" in results else {}
    return {
        "checkpoint": str(step_dir),
        "step": int(step),
        "loss": results["eval/loss"],
        **perplexity,
        "batches": held_out.batches,
        "samples": held_out.batches * held_out.batch_size,
        "rank": run.rank,
        "backend": run.backend.name,
        "world_size": run.world_size,
        "mesh": run.dims.mesh_shape(),
        **{k: v for k, v in results.items() if k.startswith("eval/") and k not in ("eval/loss", "eval/perplexity")},
        **({"predictions": results["predictions"]} if predictions else {}),
    }


def score_checkpoint(config: Config, step_dir: Path, tasks: list[str], *, verified: bool = False,
                     limit: int | None = None, num_fewshot: int | None = None,
                     log_samples: bool = False) -> dict[str, Any]:
    """Benchmark ``tasks`` on ``step_dir``'s primary model (:mod:`crosstrain.engine.evaluate_tasks`, one
    process): the checkpoint, its step, ``scores`` (``{"<task>/<metric>": value}``) and, with ``log_samples``,
    lm-eval's per-item ``samples``."""
    from crosstrain.engine.run import build_run

    _check_verified(step_dir, verified)
    run = build_run(config, for_eval=True)
    try:
        step = _load_weights(run, step_dir)
        found = run.score_tasks(tasks, limit, num_fewshot, log_samples)
    finally:
        run.close()
    return {"checkpoint": str(step_dir), "step": int(step), **found}


def _check_verified(step_dir: Path, verified: bool) -> None:
    from crosstrain.checkpoint.verify import verify

    if not verified:
        report = verify(step_dir)
        if not report.ok:
            raise CheckpointError(f"checkpoint {str(step_dir)!r} failed verification: {report.reason}")


def _load_weights(run: Any, step_dir: Path) -> int:
    """Load the checkpoint's trainable models into ``run`` (the backend's checkpointer reshards any saved layout
    onto this one); returns its step."""
    from crosstrain.checkpoint.app_state import ModelOptimizerState
    from crosstrain.checkpoint.backend_storage import backend_checkpointer

    primary = run.primary
    # A pipeline stage holds only its own blocks: the saved tensors of the other stages are read but not
    # applied (strict=False); tensors the stage has and the checkpoint lacks are still an error (load_into).
    strict = run.dims.pp == 1
    state = {m.checkpoint_key(m is primary): ModelOptimizerState(m.module, strict=strict) for m in run.trainable}
    return int(backend_checkpointer(run.backend, None).load_into(step_dir, state))
