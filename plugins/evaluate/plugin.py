"""The evaluate plugin's hook (thin: the work is in :mod:`crosstrain.plugins.evaluate.adapter` and
:mod:`crosstrain.plugins.evaluate.tasks`): lm-evaluation-harness tasks scored in process on a crosstrain model."""

from __future__ import annotations

from typing import Any

from crosstrain import hookimpl


@hookimpl
def crosstrain_score_tasks(request: Any) -> dict[str, Any]:
    from crosstrain.plugins.evaluate.tasks import require_lm_eval, score

    require_lm_eval()
    from crosstrain.generation.sharded import unwrap
    from crosstrain.plugins.evaluate.adapter import CrosstrainLM

    model = request.model
    lm = CrosstrainLM(model, request.tokenizer, max_length=int(unwrap(model).config.max_seq_len),
                      autocast=request.autocast)
    found = score(lm, list(request.tasks), limit=request.limit, num_fewshot=request.num_fewshot,
                  log_samples=request.log_samples)
    return {"scores": found.scores, "samples": found.samples, "versions": found.versions}


@hookimpl
def crosstrain_report_panels() -> list[Any]:
    """The accuracy-like scores of ``eval.tasks`` against the step (every score is in metrics.jsonl)."""
    from crosstrain.plugins.observability.panels import Panel

    return [Panel("eval_tasks", "Benchmark tasks (lm-eval)", keys=("eval/*/acc", "eval/*/acc_norm",
                                                                    "eval/*/exact_match*"), ylabel="score")]
