"""RLHF post-training for crosstrain: ``crosstrain train --recipe sft|rm|dpo|grpo|ppo`` (docs/rlhf.md).

The losses are pure functions in :mod:`crosstrain.plugins.rlhf.losses`; the JSONL readers, chat template and the
embedded synthetic tasks in :mod:`.data` and :mod:`.synthetic`; the recipes in :mod:`.recipes` (sft, rm, dpo)
and :mod:`.rl` (grpo, ppo).
"""
