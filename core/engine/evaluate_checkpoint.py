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


def evaluate_checkpoint(config: Config, step_dir: Path) -> dict[str, Any]:
    """Evaluate ``step_dir``'s weights on ``config``'s validation data (all ranks call); returns the figures
    (the same on every rank; ``rank`` says whose)."""
    from crosstrain.checkpoint.app_state import ModelOptimizerState
    from crosstrain.checkpoint.backend_storage import backend_checkpointer
    from crosstrain.checkpoint.verify import verify
    from crosstrain.engine.trainer import Trainer

    report = verify(step_dir)
    if not report.ok:
        raise CheckpointError(f"checkpoint {str(step_dir)!r} failed verification: {report.reason}")
    trainer = Trainer(config)
    trainer.eval_only = True
    try:
        trainer.setup_models()
        if trainer.eval_dataset is None:
            raise ConfigError("this run's data has no validation part; pass --data TOKEN_FILE (or set "
                              "data.val_fraction > 0)")
        primary = trainer.primary
        # A pipeline stage holds only its own blocks: the saved tensors of the other stages are read but not
        # applied (strict=False); tensors the stage has and the checkpoint lacks are still an error (load_into).
        strict = trainer.dims.pp == 1
        state = {m.checkpoint_key(m is primary): ModelOptimizerState(m.module, strict=strict)
                 for m in trainer.trainable}
        step = backend_checkpointer(trainer.backend, None).load_into(step_dir, state)
        results = trainer.evaluate()
        rank, world = trainer.rank, trainer.world_size  # before teardown leaves the process group
    finally:
        trainer.teardown()
    perplexity = {"perplexity": results["eval/perplexity"]} if "eval/perplexity" in results else {}
    return {"checkpoint": str(step_dir), "step": int(step), "loss": results["eval/loss"], **perplexity,
            "batches": trainer.eval_batches, "samples": trainer.eval_batches * trainer.eval_batch_size,
            "rank": rank, "world_size": world, "mesh": trainer.dims.mesh_shape(),
            **{k: v for k, v in results.items() if k.startswith("eval/") and k not in ("eval/loss", "eval/perplexity")}}
