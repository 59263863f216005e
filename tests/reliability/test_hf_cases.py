"""HF configs out of range or disagreeing with the safetensors headers: a CheckpointError
naming the file and the field or tensor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from lever_actors.checkpoints.hf import load_hf
from lever_actors.errors import CheckpointError
from tests.reliability.tiny import assert_consistent, edit_json, write_hf


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    return write_hf(tmp_path / "hf")


def _expect_error(directory: Path, *fragments: str) -> None:
    with pytest.raises(CheckpointError) as err:
        load_hf(directory, torch.float64)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_the_unchanged_checkpoint_loads(hf_dir: Path) -> None:
    assert_consistent(load_hf(hf_dir, torch.float64))


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("hidden_size", -16, "hidden_size = -16 is not positive"),
        ("hidden_size", 0, "hidden_size = 0 is not positive"),
        ("vocab_size", 0, "vocab_size = 0 is not positive"),
        ("num_hidden_layers", -1, "num_hidden_layers = -1 is not positive"),
        ("num_attention_heads", 0, "num_attention_heads = 0 is not positive"),
        ("num_key_value_heads", 3, "num_key_value_heads = 3 does not divide num_attention_heads"),
        ("intermediate_size", 0, "intermediate_size = 0 is not positive"),
        ("max_position_embeddings", 0, "max_position_embeddings = 0 is not positive"),
        ("rms_norm_eps", float("nan"), "rms_norm_eps = nan is not in (0, 1.0)"),
        ("rms_norm_eps", 2.0, "rms_norm_eps = 2.0 is not in (0, 1.0)"),
        ("hidden_size", "16", "Expected `int`, got `str` - at `$.hidden_size`"),
        ("hidden_size", 16.0, "Expected `int`, got `float` - at `$.hidden_size`"),
        ("tie_word_embeddings", "no", "at `$.tie_word_embeddings`"),
        ("vocab_size", None, "Expected `int`, got `null` - at `$.vocab_size`"),
    ],
)
def test_bad_config_values_name_the_field(hf_dir: Path, key: str, value: Any, fragment) -> None:
    edit_json(hf_dir / "config.json", lambda config: config.update({key: value}))
    _expect_error(hf_dir, str(hf_dir / "config.json"), fragment)


@pytest.mark.parametrize(
    ("rope", "fragment"),
    [
        ({"rope_type": "default", "rope_theta": 0}, "rope_theta = 0.0 is not finite and positive"),
        ({"rope_type": "linear", "rope_theta": 1e4}, "linear rope scaling lacks factor"),
        ({"rope_type": "linear", "factor": -2.0}, "rope_scaling.factor = -2.0 is not finite"),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "rope_scaling.high_freq_factor = 4.0 is not above rope_scaling.low_freq_factor",
        ),
        ({"rope_type": "yarn", "factor": 4.0}, "unsupported rope_scaling type 'yarn'"),
        ("linear", "Expected `object | null`, got `str` - at `$.rope_parameters`"),
    ],
)
def test_bad_rope_settings(hf_dir: Path, rope: Any, fragment: str) -> None:
    edit_json(hf_dir / "config.json", lambda config: config.update(rope_parameters=rope))
    _expect_error(hf_dir, fragment)


def test_a_missing_field(hf_dir: Path) -> None:
    edit_json(hf_dir / "config.json", lambda config: config.pop("intermediate_size"))
    _expect_error(hf_dir, "missing required field `intermediate_size`")


@pytest.mark.parametrize("text", ["[1, 2]", "{", '"config"'])
def test_a_config_that_is_not_an_object(hf_dir: Path, text: str) -> None:
    (hf_dir / "config.json").write_text(text)
    _expect_error(hf_dir, str(hf_dir / "config.json"))


def test_a_config_that_disagrees_with_the_tensors(hf_dir: Path) -> None:
    edit_json(hf_dir / "config.json", lambda config: config.update(num_key_value_heads=4))
    _expect_error(
        hf_dir,
        "model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' has shape (8, 16)",
        "config.json implies (16, 16)",
    )


def test_a_tensor_of_the_wrong_shape(hf_dir: Path) -> None:
    path = hf_dir / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :20].contiguous()
    save_file(tensors, str(path))
    _expect_error(hf_dir, f"{path}: tensor '{name}' has shape (16, 20)", "implies (16, 24)")


def test_fewer_layers_than_the_tensors_hold(hf_dir: Path) -> None:
    edit_json(hf_dir / "config.json", lambda config: config.update(num_hidden_layers=1))
    _expect_error(hf_dir, "num_hidden_layers = 1, but the file holds tensors of layer 1")


@pytest.mark.parametrize(
    ("index", "fragment"),
    [
        ({"weight_map": ["model.safetensors"]}, "no 'weight_map' object"),
        ([], "no 'weight_map' object"),
        ({"weight_map": {"model.embed_tokens.weight": 3}}, "weight_map shard 3"),
        ({"weight_map": {"model.embed_tokens.weight": "absent.safetensors"}}, "absent.safetensors"),
        (
            {"weight_map": {"model.embed_tokens.weight": "config.json"}},
            "not a readable safetensors",
        ),
    ],
)
def test_a_bad_index(hf_dir: Path, index: Any, fragment: str) -> None:
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect_error(hf_dir, fragment)


def test_an_index_naming_a_shard_without_the_tensor(hf_dir: Path) -> None:
    weight_map = dict.fromkeys(load_file(str(hf_dir / "model.safetensors")), "model.safetensors")
    weight_map["model.norm.weight"] = "other.safetensors"
    save_file({"x": torch.zeros(1)}, str(hf_dir / "other.safetensors"))
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _expect_error(hf_dir, "other.safetensors: cannot read tensor 'model.norm.weight'")
