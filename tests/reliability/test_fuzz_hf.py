"""Fuzz the HF config and shard-index reader: random JSON values for the config's fields (or
for the whole config), and random weight maps. Every case ends in a CheckpointError or in a
checkpoint whose shapes agree with its args; nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

from lever_actors.checkpoints.hf import load_hf
from tests.reliability.fuzz import DELETE, examples, json_values, load_or_refuse
from tests.reliability.tiny import write_hf

CONFIG_KEYS = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "rope_parameters",
    "rope_scaling",
]
ROPE_KEYS = ["rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor"]
rope_settings = st.fixed_dictionaries(
    {"rope_type": st.sampled_from(["default", "linear", "llama3", "yarn"])},
    optional={key: json_values for key in ROPE_KEYS[1:]},
)
shard_names = st.sampled_from(
    ["model.safetensors", "config.json", "absent.safetensors", "../model.safetensors", ""]
) | st.text(max_size=6)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf(tmp_path_factory.mktemp("hf-fuzz") / "hf")


@pytest.fixture(scope="module")
def originals(hf_dir: Path) -> tuple[dict, list[str]]:
    """The valid config and the names of the stored tensors."""
    config = json.loads((hf_dir / "config.json").read_text())
    return config, sorted(load_file(str(hf_dir / "model.safetensors")))


def _write(hf_dir: Path, config: object, index: object) -> None:
    (hf_dir / "config.json").write_text(json.dumps(config))
    index_path = hf_dir / "model.safetensors.index.json"
    index_path.unlink(missing_ok=True)
    if index is not DELETE:
        index_path.write_text(json.dumps(index))


@st.composite
def config_values(draw: st.DrawFn, original: object) -> object:
    """A value for one config field: near the original number, or any JSON at all."""
    near = st.nothing()
    if isinstance(original, int | float) and not isinstance(original, bool):
        near = st.integers(-3, 3).map(lambda d: original + d) | st.sampled_from([0, -original])
    return draw(near | json_values | rope_settings | st.just(DELETE))


@examples(0.4)
@given(data=st.data())
def test_random_config_values(hf_dir: Path, originals, data: st.DataObject) -> None:
    config = dict(originals[0])
    for key in data.draw(st.lists(st.sampled_from(CONFIG_KEYS), min_size=1, max_size=4)):
        config[key] = data.draw(config_values(config.get(key)))
    config = {key: value for key, value in config.items() if value is not DELETE}
    if data.draw(st.integers(0, 9)) == 5:  # now and then not an object with fields at all
        config = data.draw(json_values)
    _write(hf_dir, config, DELETE)
    load_or_refuse(lambda: load_hf(hf_dir, torch.float64))


@examples(0.4)
@given(data=st.data())
def test_random_weight_maps(hf_dir: Path, originals, data: st.DataObject) -> None:
    config, names = originals
    full = dict.fromkeys(names, "model.safetensors")
    shards = st.dictionaries(st.sampled_from(names), st.just(DELETE) | shard_names, max_size=3)
    weight_map = {k: v for k, v in {**full, **data.draw(shards)}.items() if v is not DELETE}
    index = {"weight_map": weight_map}
    kind = data.draw(st.integers(0, 5))  # mostly a real weight map with a few entries changed
    if kind == 2:
        index = data.draw(json_values)
    elif kind == 3:
        index = {"weight_map": data.draw(json_values)}
    _write(hf_dir, config, index)
    load_or_refuse(lambda: load_hf(hf_dir, torch.float64))
