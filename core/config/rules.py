"""The combinations crosstrain refuses, in one table: each rule is a predicate over ``(config, dims)`` and a line.

:func:`check_world` (the launcher before any worker starts, and every worker) calls :func:`check_rules` with the
resolved :class:`~crosstrain.parallel.ParallelDims`, so a refused combination is one line and exit 2 before any
process, file or model exists. Plugins add the rules about what they bring through the
``crosstrain_refusal_rules`` hook; the core names no plugin. ``crosstrain.testing.matrix`` decides which cells
of the layout x feature matrix are refused from this table, and docs/parallelism.md's table is generated from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from crosstrain.errors import ConfigError


@dataclass(frozen=True)
class Rule:
    """Refuse a run when ``applies(config, dims)``; the error is ``f"{problem(config, dims)}; {fix}"``.

    ``when`` says the same as ``applies`` in words (the docs table shows it); ``owner`` is ``core`` or the plugin.
    """

    name: str
    owner: str
    when: str
    fix: str
    applies: Callable[[Any, Any], bool]
    problem: Callable[[Any, Any], str]

    def message(self, config: Any, dims: Any) -> str:
        return f"{self.problem(config, dims)}; {self.fix}"


def _recipe_supports_pipeline(config: Any) -> bool:
    from crosstrain.engine.recipe import resolve_recipe

    return bool(resolve_recipe(config.train.recipe).supports_pipeline)


CORE_RULES = (
    Rule("pp-recipe", "core", "`parallel.pp > 1` with a recipe that does not declare `supports_pipeline`",
         "set parallel.pp=1",
         lambda c, d: d.pp > 1 and not _recipe_supports_pipeline(c),
         lambda c, d: f"train.recipe={c.train.recipe!r} does not run under pipeline parallelism (it needs one "
                      "model and a pipeline loss)"),
    Rule("packing-pp", "core", "`data.packing = \"documents\"` with `parallel.pp > 1` or `model.import_path`",
         "set data.packing='concat'",
         lambda c, d: c.data.packing == "documents" and (d.pp > 1 or bool(c.model.import_path)),
         lambda c, d: "data.packing='documents' needs the built-in GPT (it takes doc_ids) and parallel.pp=1"),
    Rule("compile-tp", "core", "`parallel.compile = true` with `parallel.tp > 1`", "set compile=false or tp=1",
         lambda c, d: c.parallel.compile is True and d.tp > 1,
         lambda c, d: "parallel.compile with parallel.tp > 1 fails in this torch build"),
    Rule("eval-tasks-world", "core", "`eval.tasks` with more than one process",
         "train with one process, or score the checkpoint after training: crosstrain eval RUN --tasks ...",
         lambda c, d: bool(c.eval.tasks) and d.world_size > 1,
         lambda c, d: f"eval.tasks are scored in one process, and this run has {d.world_size}"),
)


def all_rules() -> list[Rule]:
    """The core rules, then each plugin's (``crosstrain_refusal_rules``), in plugin registration order."""
    from crosstrain import pluginmanager

    rules = list(CORE_RULES)
    for plugin_name, found in pluginmanager.call_each("crosstrain_refusal_rules"):
        for rule in found or []:
            if not isinstance(rule, Rule):
                pluginmanager.record_error(plugin_name, f"refusal rule {rule!r} is not a crosstrain.config.rules.Rule")
                continue
            rules.append(rule)
    return rules


def refusal(config: Any, dims: Any) -> Rule | None:
    """The first rule that refuses ``config`` on ``dims`` (resolved), or None when the combination is admitted."""
    return next((rule for rule in all_rules() if rule.applies(config, dims)), None)


def check_rules(config: Any, dims: Any) -> None:
    """Raise the first refusing rule's one-line :class:`ConfigError` (exit 2)."""
    rule = refusal(config, dims)
    if rule is not None:
        raise ConfigError(rule.message(config, dims))


def rules_table(rules: list[Rule] | None = None) -> str:
    """The markdown table of every rule (what docs/parallelism.md shows between its generated-section markers)."""
    rows = ["| refused combination | fix | rule (owner) |", "|---|---|---|"]
    for rule in all_rules() if rules is None else rules:
        rows.append(f"| {rule.when} | {rule.fix} | `{rule.name}` ({rule.owner}) |")
    return "\n".join(rows)
