"""The layouts ``[quant]`` refuses (``crosstrain_refusal_rules``; the table is :mod:`crosstrain.config.rules`)."""

from __future__ import annotations

from typing import Any

from crosstrain.config.rules import Rule


def _qat(config: Any) -> str:
    return str(config.section("quant").qat)


def _lora(config: Any) -> int:
    try:
        return int(config.section("lora").rank)
    except Exception:  # the rlhf plugin (and its [lora] section) is not installed
        return 0


RULES = (
    Rule("qat-lora", "compress", "`quant.qat` set with `lora.rank > 0`", "set quant.qat=\"none\" or lora.rank=0",
         lambda c, d: _qat(c) != "none" and _lora(c) > 0,
         lambda c, d: f"quant.qat={_qat(c)!r} with lora.rank={_lora(c)}: LoRA-adapted layers are not "
                      "fake-quantised yet"),
)
