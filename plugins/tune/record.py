"""What a study measures: its search space (with the metric) and its base config, recorded as study user attrs
when the study is created and compared when it is continued, so trials of two different searches never mix.

Each is stored twice: a SHA-256 of its canonical JSON (the check) and a short form (the message): the space as
its entries, the base config as the keys that differ from the defaults (what ``--config``/``--set`` changed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from crosstrain.errors import ConfigError
from crosstrain.plugins.tune.config import SearchSettings
from crosstrain.plugins.tune.space import Param

SPACE, BASE = "space", "base_config"


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1e-3}}`` -> ``{"optim.lr": 1e-3}`` (the keys ``--set`` writes)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def describe(settings: SearchSettings, params: list[Param], base: Any) -> dict[str, dict[str, Any]]:
    """The study's record: ``space`` (metric, direction, every searched key's range) and ``base_config`` (the
    base config's keys that differ from the defaults), each with the SHA-256 of the canonical whole."""
    from crosstrain.config import load_config

    space = {"metric": settings.metric, "direction": settings.direction,
             **{p.key: {k: v for k, v in dataclasses.asdict(p).items() if k != "key" and _set(v)} for p in params}}
    whole = flat(base.to_dict())
    defaults = flat(load_config().to_dict())
    changed = {k: v for k, v in whole.items() if defaults.get(k, object()) != v}
    return {SPACE: {"sha256": _sha(space), "short": space}, BASE: {"sha256": _sha(whole), "short": changed}}


def _set(value: Any) -> bool:
    """Whether a range's field says something (``low = 0`` does; ``log = false``, no ``step``, no choices do not)."""
    return value is not None and value is not False and value != ()


def _sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def check(study: Any, record: dict[str, dict[str, Any]]) -> None:
    """Refuse to continue ``study`` when its recorded space or base config differs from ``record``, naming the
    first keys that differ; a study created before records existed gets this one."""
    attrs = study.user_attrs
    for what in (SPACE, BASE):
        stored = attrs.get(what)
        if stored is None:
            study.set_user_attr(what, _plain(record[what]))
            continue
        if stored.get("sha256") == record[what]["sha256"]:
            continue
        label = "search space" if what == SPACE else "base config"
        differs = _differences(stored["short"], record[what]["short"], "not searched" if what == SPACE else "default")
        raise ConfigError(f"study {study.study_name!r} was run with another {label} ({differs}); "
                          "pass the same space file and --config/--set to continue it, or --study NEW_NAME to "
                          "start another study")


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))  # tuples to lists: what the storage gives back


def _differences(stored: dict[str, Any], now: dict[str, Any], missing: str, limit: int = 3) -> str:
    now = _plain(now)
    keys = sorted(k for k in set(stored) | set(now) if stored.get(k) != now.get(k))
    if not keys:
        return "the defaults of this crosstrain differ from those the study was run with"
    shown = [f"{k}: {_show(stored, k, missing)} in the study, {_show(now, k, missing)} now" for k in keys[:limit]]
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return "; ".join(shown) + more


def _show(tree: dict[str, Any], key: str, missing: str) -> str:
    return json.dumps(tree[key]) if key in tree else missing
