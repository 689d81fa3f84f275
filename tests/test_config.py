"""Config: TOML + --set overrides, type coercion, one-line errors naming the key, plugin sections."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from crosstrain import hookimpl, pluginmanager
from crosstrain.config import check_world, load_config, save_config
from crosstrain.errors import ConfigError


def test_defaults_are_the_no_argument_run() -> None:
    c = load_config(None, [])
    assert c.model.preset == "tiny" and c.data.path == "" and c.backend == "auto"
    assert c.checkpoint.every == 100 and c.checkpoint.every_minutes == 10.0 and c.checkpoint.async_save is False
    assert c.parallel.dp_shard == -1 and c.precision.dtype == "fp32"


def test_toml_file_and_overrides_with_coercion(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('backend = "cpu"\n[train]\nsteps = 7\n[optim]\nlr = 1e-3\n[checkpoint]\nasync = true\n')
    c = load_config(path, ["optim.lr=3e-4", "train.batch_size=32", "precision.dtype=bf16", "optim.name=sgd",
                           "checkpoint.resume=auto", "optim.betas=[0.8, 0.9]", "model.options.width=3"])
    assert c.backend == "cpu" and c.train.steps == 7 and c.checkpoint.async_save is True
    assert c.optim.lr == pytest.approx(3e-4) and isinstance(c.optim.lr, float)
    assert c.train.batch_size == 32 and c.precision.dtype == "bf16" and c.optim.name == "sgd"
    assert c.optim.betas == (0.8, 0.9) and c.model.options == {"width": 3}
    # a string that looks like a number is still accepted where a number is expected
    assert load_config(None, ['train.steps="12"']).train.steps == 12


def test_effective_config_round_trips(tmp_path) -> None:
    c = load_config(None, ["optim.lr=3e-4", "checkpoint.async=true", "train.steps=9", "model.dim=32"])
    save_config(c, tmp_path)
    again = load_config(tmp_path / "config.toml", [])
    assert again.to_dict() == c.to_dict()
    assert (tmp_path / "config.json").read_text().count('"async": true') == 1


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["train.stepz=3"], "unknown config key 'train.stepz'; allowed keys in [train]: steps"),
        (["train.steps=abc"], "'train.steps'"),
        (["train.steps=0"], "'train.steps'"),
        (["optim.name=lamb"], "'adamw' or 'sgd'"),
        (["precision.dtype=fp8"], "'precision.dtype'"),
        (["foo.bar=1"], "unknown config section 'foo'"),
        (["model.preset=huge"], "unknown model.preset 'huge'; allowed: tiny"),
        (["parallel.ep=0"], "'parallel.ep'"),
        (["train.batch_size=10", "train.grad_accum=3"], "train.batch_size=10 must be divisible by train.grad_accum"),
        (["train.seq_len=4096"], "train.seq_len=4096 exceeds"),
        (["model.n_heads=3"], "model.dim=64 must be divisible by model.n_heads=3"),
        (["parallel.activation_checkpoint=some"], "'parallel.activation_checkpoint'"),
        (["checkpoint.asyn=true"],
         "allowed keys in [checkpoint]: every, every_minutes, keep_last, keep_every, keep_best, async, final, resume"),
        (["data.path=/nonexistent/x.bin"], "data.path '/nonexistent/x.bin' does not exist"),
        (["model.import_path=nocolon"], "must look like 'package.module:name'"),
        (["optim.lr"], "must look like section.key=value"),
        (["train.steps=1", "train.steps.x=1"], "train.steps is a value, not a section"),
    ],
)
def test_bad_values_give_one_line_errors(overrides, needle) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    msg = str(info.value)
    assert needle in msg and "\n" not in msg


def test_missing_and_malformed_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", [])
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, [])
    typo = tmp_path / "typo.toml"
    typo.write_text("[optim]\nlearning_rate = 0.1\n")
    with pytest.raises(ConfigError, match="unknown config key 'optim.learning_rate'"):
        load_config(typo, [])


@pytest.mark.parametrize(
    "overrides, world, needle",
    [
        (["parallel.dp_replicate=2", "parallel.dp_shard=2"], 2, "but the world size is 2"),
        (["parallel.tp=3"], 3, "parallel.tp=3 must divide model.n_heads=4"),
        (["parallel.pp=4", "parallel.dp_shard=1"], 4, "parallel.pp=4 exceeds model.n_layers=2"),
        (["parallel.dp_replicate=3"], 2, "does not divide the world size 2"),
        (["train.batch_size=6"], 4, "train.batch_size=6 must be divisible by the data-parallel degree (4)"),
    ],
)
def test_world_size_checks(overrides, world, needle) -> None:
    config = load_config(None, overrides)
    with pytest.raises(ConfigError) as info:
        check_world(config, world)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_world_size_resolves_dp_shard() -> None:
    dims = check_world(load_config(None, ["parallel.tp=2"]), 4)
    assert (dims.dp_shard, dims.tp, dims.dp_degree) == (2, 2, 2)


class _DemoSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    level: int = 1
    name: str = "x"


class _DemoPlugin:
    @hookimpl
    def crosstrain_config_sections(self) -> dict[str, type]:
        return {"demo": _DemoSection}


@pytest.fixture
def demo_plugin():
    pluginmanager.register(_DemoPlugin(), name="demo-config-plugin")
    yield
    pluginmanager.unregister("demo-config-plugin")


def test_plugin_sections(demo_plugin, tmp_path) -> None:
    c = load_config(None, ["demo.level=5"])
    assert c.section("demo").level == 5 and c.section("train") is c.train
    with pytest.raises(ConfigError, match="unknown config key 'demo.levle'; allowed keys in \\[demo\\]: level, name"):
        load_config(None, ["demo.levle=5"])
    with pytest.raises(ConfigError, match="invalid value for 'demo.level'"):
        load_config(None, ["demo.level=high"])
    save_config(c, tmp_path)
    assert load_config(tmp_path / "config.toml", []).section("demo").level == 5
    with pytest.raises(KeyError, match="known sections"):
        c.section("nope")
