"""Config flattening: ``run_metadata.config_as_dict`` / ``flatten_params`` / ``batches`` (no server)."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import logging
from pathlib import PurePosixPath

import pytest

from otel_forge.mlflow.training.run_metadata import (
    LAUNCH_CONFIG_MAX_BYTES,
    LAUNCH_CONFIG_MAX_VALUES,
    PARAM_VALUE_MAX_CHARS,
    PARAMS_PER_BATCH,
    batches,
    config_as_dict,
    flatten_params,
    launch_config_path,
    launch_file_text,
    load_launch_config,
)


@dataclasses.dataclass
class Optim:
    name: str = "adamw"
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)


@dataclasses.dataclass
class Train:
    model: dict = dataclasses.field(default_factory=lambda: {"dim": 8, "layers": [4, 4]})
    optim: Optim = dataclasses.field(default_factory=Optim)
    resume_from: str | None = None
    seed: int = 0


class Color(enum.Enum):
    RED = "red"


def test_nested_dataclass_dict_and_lists_become_dotted_params():
    assert flatten_params(Train()) == {
        "model.dim": "8",
        "model.layers.0": "4",
        "model.layers.1": "4",
        "optim.name": "adamw",
        "optim.lr": "0.0003",
        "optim.betas.0": "0.9",
        "optim.betas.1": "0.95",
        "seed": "0",
    }


def test_none_is_skipped_everywhere_and_keeps_list_indices():
    assert flatten_params({"a": None, "b": [1, None, 3], "c": {"d": None}}) == {"b.0": "1", "b.2": "3"}
    assert flatten_params(None) == {}


def test_empty_containers_give_no_params():
    assert flatten_params({"a": {}, "b": [], "c": ()}) == {}


def test_a_scalar_config_is_one_param_named_value():
    assert flatten_params(5) == {"value": "5"}
    assert flatten_params("x") == {"value": "x"}


def test_values_are_cut_to_the_store_limit():
    assert PARAM_VALUE_MAX_CHARS == 6000
    flat = flatten_params({"long": "x" * 7000, "short": "y" * 6000})
    assert flat["long"] == "x" * 5975 + "...[1025 more characters]"
    assert flat["short"] == "y" * 6000
    assert flatten_params({"v": "abcdef"}, max_chars=3) == {"v": "abc"}


def test_non_string_keys_are_stringified():
    flat = flatten_params({1: "one", 2.5: {True: "t"}, None: "n"})
    assert flat == {"1": "one", "2.5.True": "t", "None": "n"}
    assert config_as_dict({1: {2: 3}}) == {"1": {"2": 3}}


def test_argparse_namespace():
    namespace = argparse.Namespace(lr=0.1, epochs=3, tags=["a", "b"], out=None)
    assert config_as_dict(namespace) == {"lr": 0.1, "epochs": 3, "tags": ["a", "b"], "out": None}
    assert flatten_params(namespace) == {"lr": "0.1", "epochs": "3", "tags.0": "a", "tags.1": "b"}


def test_pydantic_model_nested_and_inside_a_dataclass():
    pydantic = pytest.importorskip("pydantic")  # mlflow depends on it: installed here

    class Data(pydantic.BaseModel):
        path: str = "/data"
        shards: list[int] = pydantic.Field(default_factory=lambda: [0, 1])

    class Config(pydantic.BaseModel):
        data: Data = Data()
        batch: int = 32
        note: str | None = None

    assert config_as_dict(Config()) == {"data": {"path": "/data", "shards": [0, 1]}, "batch": 32, "note": None}
    assert flatten_params(Config()) == {"data.path": "/data", "data.shards.0": "0", "data.shards.1": "1", "batch": "32"}

    @dataclasses.dataclass
    class Outer:
        inner: Config = dataclasses.field(default_factory=Config)

    assert flatten_params(Outer())["inner.data.path"] == "/data"


def test_other_values_are_stringified():
    flat = flatten_params({"color": Color.RED, "path": PurePosixPath("/a/b"), "flag": False, "f": 1e-8})
    assert flat == {"color": "Color.RED", "path": "/a/b", "flag": "False", "f": "1e-08"}


def test_config_as_dict_records_a_dataclass_type_as_its_name_not_its_fields():
    assert config_as_dict(Optim) == str(Optim)
    assert config_as_dict(Optim()) == {"name": "adamw", "lr": 3e-4, "betas": [0.9, 0.95]}


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def test_a_value_that_cannot_be_read_costs_only_itself():
    recursive: dict = {"lr": 0.1}
    recursive["self"] = recursive
    plain = config_as_dict({"odd": Unprintable(), "loop": recursive, "ok": 1})
    assert plain == {"odd": "<unprintable Unprintable>", "loop": {"lr": 0.1, "self": "<cycle>"}, "ok": 1}
    assert flatten_params(plain) == {
        "odd": "<unprintable Unprintable>",
        "loop.lr": "0.1",
        "loop.self": "<cycle>",
        "ok": "1",
    }


def test_batches_of_one_hundred():
    assert PARAMS_PER_BATCH == 100
    params = {f"p{i}": str(i) for i in range(250)}
    chunks = batches(params)
    assert [len(chunk) for chunk in chunks] == [100, 100, 50]
    assert {k: v for chunk in chunks for k, v in chunk.items()} == params
    assert list(chunks[0]) == [f"p{i}" for i in range(100)]  # order kept
    assert batches({}) == []
    assert [len(c) for c in batches({f"p{i}": "" for i in range(100)})] == [100]


def test_launch_config_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.toml").write_text("a = 1\n")
    (tmp_path / "cfg.YAML").write_text("a: 1\n")
    assert launch_config_path(["train.py", "cfg.toml"]) == tmp_path / "cfg.toml"
    assert launch_config_path(["train.py", "--config=cfg.toml"]) == tmp_path / "cfg.toml"
    assert launch_config_path(["train.py", "cfg.YAML"]) == tmp_path / "cfg.YAML"
    assert launch_config_path(["cfg.toml"]) is None  # argv[0] is the program
    assert launch_config_path(["train.py", "missing.json"]) is None
    assert launch_config_path(["train.py", "notes.txt"]) is None


def test_a_json_file_is_the_config_only_when_a_config_option_names_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("data.json", "run.json", "cfg.yaml"):
        (tmp_path / name).write_text("{}\n")
    assert launch_config_path(["train.py", "data.json"]) is None  # a data file
    assert launch_config_path(["train.py", "data.json", "cfg.yaml"]) == tmp_path / "cfg.yaml"
    for argv in (["--config", "run.json"], ["--config=run.json"], ["--cfg", "run.json"], ["config=run.json"]):
        assert launch_config_path(["train.py", "data.json", *argv, "cfg.yaml"]) == tmp_path / "run.json", argv
    assert launch_config_path(["train.py", "train.config=run.json"]) == tmp_path / "run.json"  # an override
    assert launch_config_path(["train.py", "/srv/config/data.json"]) is None  # a path is no option


def test_a_launch_file_past_its_limits_is_neither_parsed_nor_uploaded(tmp_path, caplog):
    # An alias bomb: 10 levels of ten aliases each, 10**10 values once expanded, 1 KB of text.
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(levels) + "\n")
    many = tmp_path / "many.json"
    many.write_text(json.dumps({f"k{i}": i for i in range(LAUNCH_CONFIG_MAX_VALUES + 1)}))
    big = tmp_path / "big.toml"
    big.write_text("a = 1\n" + "#" * LAUNCH_CONFIG_MAX_BYTES)
    with caplog.at_level(logging.WARNING):
        assert load_launch_config(bomb) is None and load_launch_config(many) is None
        assert load_launch_config(big) is None and launch_file_text(big) is None
    assert len([r for r in caplog.records if "not parsed" in r.getMessage()]) == 2
    aliased = tmp_path / "aliased.yaml"
    aliased.write_text("base: &base {lr: 0.1}\ntrain: *base\n")
    assert load_launch_config(aliased) == {"base": {"lr": 0.1}, "train": {"lr": 0.1}}  # aliases are fine


def test_a_param_value_past_mlflows_limit_is_cut_with_a_marker_saying_how_much_is_missing():
    value = "a" * 1_048_576
    (param,) = flatten_params({"huge": value}).values()
    assert len(param) <= 6000 and param.startswith("a" * 5900)
    missing = int(param.rsplit("...[", 1)[1].split(" ")[0])
    assert param.endswith(f"...[{missing} more characters]") and len(param) - len(
        f"...[{missing} more characters]"
    ) + missing == len(value)
    assert flatten_params({"fits": "b" * 6000}) == {"fits": "b" * 6000}


def _large_flat_config() -> dict[str, object]:
    """The shape of a sweep's or a framework's dump: 5,000 flat entries of every scalar kind."""
    kinds = (lambda i: i * 0.5, lambda i: i, lambda i: f"value-{i}", lambda i: i % 2 == 0, lambda i: None)
    return {f"param_{i:04d}": kinds[i % len(kinds)](i) for i in range(5_000)}


def test_a_large_flat_config_is_described_whole_param_by_param():
    from otel_forge.mlflow.training.run_description import CONFIG_ARTIFACT, RunDescription
    from otel_forge.node import NodeIdentity
    from otel_forge.ratelimit import RateLimitedLogger
    from otel_forge.scrub import SecretKeys

    config = _large_flat_config()
    description = RunDescription(
        config, None, {}, ["train.py"], SecretKeys(), RateLimitedLogger(logging.getLogger(__name__))
    )
    records = description.records(NodeIdentity.detect(environ={}))
    params = [record.payload for record in records if record.kind == "params"]
    # Every value but None, as its text, each key once, in MLflow's calls of 100 and in the config's order.
    expected = {key: str(value) for key, value in config.items() if value is not None}
    assert len(expected) == 4_000
    assert [len(batch) for batch in params] == [100] * 40
    assert [key for batch in params for key in batch] == list(expected)
    assert {key: value for batch in params for key, value in batch.items()} == expected
    (artifact,) = [record.payload for record in records if record.kind == "dict"]
    assert artifact == {"name": CONFIG_ARTIFACT, "data": config}
