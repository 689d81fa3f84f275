""":class:`GenericConfig`: what the generic path builds, from the run's ``[model]`` section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from crosstrain.errors import ConfigError

#: config.json keys that give the longest sequence a model was built for, in the order families use them
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length", "n_ctx")
DEFAULT_MAX_SEQ_LEN = 2048  # models with no position limit in their config (ALiBi: Bloom)


@dataclass(frozen=True)
class GenericConfig:
    """A transformers causal LM: its ``config.json`` fields and where its weights come from.

    ``init_from``: a Hugging Face folder (its safetensors are loaded; a folder with only ``config.json`` gives
    random weights) or ``""`` (``hf_config`` is built from the run's native preset, randomly initialised).
    ``max_seq_len``: the longest sequence crosstrain feeds it (``model.max_seq_len``, else the config's).
    """

    hf_config: dict[str, Any] = field(default_factory=dict)
    init_from: str = ""
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN

    @property
    def model_type(self) -> str:
        return str(self.hf_config.get("model_type", ""))

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.get("vocab_size") or 0)


def require_transformers() -> Any:
    """The ``transformers`` module, or a one-line error naming the extra."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.source='transformers' (the generic path) needs transformers: "
                          "pip install 'crosstrain[hf]', or set model.source='native'") from None
    return transformers


def config_length(hf_config: dict[str, Any]) -> int:
    for key in _LENGTH_KEYS:
        value = hf_config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_MAX_SEQ_LEN


#: the ``model.*`` keys that would change a shape config.json fixes
_SHAPE_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings", "qkv_bias")


def config_from_run(config: Any) -> GenericConfig:
    """``model.init_from``'s config.json (only ``model.max_seq_len`` may be set besides), or the native preset with
    the ``model.*`` overrides as a Llama config.json (``model.source = "transformers"`` without ``init_from``)."""
    m = config.model
    if not m.init_from:
        from crosstrain.models.gpt_family import config_from_run as native_config
        from crosstrain.models.hf.config import hf_config_from_gpt

        cfg = native_config(config)
        return GenericConfig(hf_config=hf_config_from_gpt(cfg), max_seq_len=cfg.max_seq_len)
    from crosstrain.checkpoint.resolve import source_kind
    from crosstrain.models.hf import read_hf_config

    if source_kind(m.init_from, what="model.init_from") != "hf":
        raise ConfigError(f"model.init_from {m.init_from!r} holds crosstrain weights, which the generic path cannot "
                          "read; point it at a Hugging Face folder or set model.source='native'")
    fixed = [k for k in _SHAPE_KEYS if getattr(m, k) is not None]
    if fixed:
        raise ConfigError(f"model.{fixed[0]} cannot be combined with model.init_from (the shape comes from "
                          f"{m.init_from}/config.json); remove model.{fixed[0]}")
    hf_config = read_hf_config(m.init_from)
    require_transformers()
    from crosstrain.models.generic.decoder import refusal

    why = refusal(hf_config, f"model.init_from {m.init_from!r}")
    if why:
        raise ConfigError(why)
    return GenericConfig(hf_config=hf_config, init_from=str(m.init_from),
                         max_seq_len=int(m.max_seq_len or config_length(hf_config)))
