"""What the placement planner reads: a model's measured layers and a catalogue of resource types."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dynamix.data.dlrm import DLRM
from lightning_dynamix.placement import ModelProfile, ResourceType, load_catalogue, profile_model
from lightning_dynamix.placement.catalogue import parse_bandwidth, parse_size

TABLES = (1000, 50, 20000)


def dlrm_batch(size: int = 64):
    sparse = torch.stack([torch.randint(0, n, (size,)) for n in TABLES], 1)
    return torch.randn(size, 13), sparse, torch.rand(size)


def test_profile_finds_the_layers_in_execution_order_with_their_sizes_and_kinds(tmp_path):
    model = DLRM(table_sizes=TABLES, embedding_dim=16, bottom_mlp=(32,), top_mlp=(16,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile = profile_model(model, dlrm_batch(), repeats=4, warmup=0)
    names = [layer.name for layer in profile.layers]
    assert names == [
        "embeddings.0", "embeddings.1", "embeddings.2",
        "bottom_mlp.0", "bottom_mlp.1", "bottom_mlp.2", "bottom_mlp.3",
        "interaction",
        "top_mlp.0", "top_mlp.1", "top_mlp.2",
    ]  # fmt: skip
    layers = {layer.name: layer for layer in profile.layers}
    assert [layers[f"embeddings.{i}"].kind for i in range(3)] == ["sparse"] * 3
    assert layers["bottom_mlp.0"].kind == "dense"
    assert layers["embeddings.2"].parameter_bytes == 20000 * 16 * 4
    assert layers["bottom_mlp.0"].parameter_bytes == (13 * 32 + 32) * 4
    assert layers["bottom_mlp.0"].activation_bytes == 32 * 4  # one sample's output
    assert layers["bottom_mlp.1"].parameter_bytes == 0  # a ReLU
    # the interaction's output: the bottom vector and the dot products of the 4 vectors' 6 pairs
    assert layers["interaction"].activation_bytes == (16 + 6) * 4
    assert all(layer.seconds["cpu"] > 0 for layer in profile.layers)
    assert profile.batch_size == 64
    assert profile.step_seconds["cpu"] > 0
    # how far apart each layer's samples were, kept beside its time
    assert all(set(layer.spread) == {"cpu"} and layer.spread["cpu"] >= 0 for layer in profile.layers)
    assert set(profile.step_spread) == {"cpu"}
    assert profile.spread("cpu") >= 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # timed on copies
    profile.save(tmp_path / "profile.json")
    assert ModelProfile.load(tmp_path / "profile.json") == profile


def test_a_table_is_timed_by_the_rows_a_batch_touches_not_by_its_size():
    # the gradient of the rows looked up, as an embedding server applies it: not a zero-filled gradient
    # the size of the table (64 MiB here, some 50 times the lookup's time on this VM)
    class Table(nn.Module):
        def __init__(self, rows):
            super().__init__()
            self.table = nn.Embedding(rows, 16)

        def forward(self, ids):
            return self.table(ids)

    ids = torch.randint(0, 1000, (512,))
    small, large = (profile_model(Table(rows), ids, repeats=3).layers[0].seconds["cpu"] for rows in (1000, 2**20))
    assert large < 5 * small


def test_a_layer_called_twice_counts_both_calls():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def forward(self, x):
            return self.layer(self.layer(x))

    (layer,) = profile_model(Twice(), torch.randn(8, 4), repeats=1, warmup=0).layers
    assert layer.calls == 2


def test_a_batch_the_model_cannot_run_is_a_clear_error():
    model = DLRM(table_sizes=TABLES, embedding_dim=16)
    bad = (torch.randn(8, 5), torch.zeros(8, 3, dtype=torch.long), torch.rand(8))  # 5 dense features, not 13
    with pytest.raises(ValueError, match="DLRM cannot run a forward and backward pass on `example_batch`"):
        profile_model(model, bad)
    with pytest.raises(ValueError, match="holds no tensor with a batch dimension"):
        profile_model(model, {"x": 3})
    with pytest.raises(ValueError, match="`devices` includes 'tpu'"):
        profile_model(model, dlrm_batch(), devices=["tpu"])


CATALOGUE = """
resources:
  - name: cpu-16
    device: cpu
    price_per_hour: 0.68
    units: 32
    memory: 32GiB
    link_bandwidth: 12.5Gbit/s
  - name: a10g
    device: gpu
    price_per_hour: 1.01
    units: 8
    memory: 24 GiB
    link_bandwidth: 3.125GB/s
    relative_speed: {dense: 20, sparse: 2.5}
"""


def test_a_catalogue_reads_sizes_bandwidths_and_speeds(tmp_path):
    path = tmp_path / "catalogue.yaml"
    path.write_text(CATALOGUE)
    cpu, gpu = load_catalogue(path)
    assert cpu == ResourceType("cpu-16", "cpu", 0.68, 32, 32 * 2**30, 12.5e9 / 8, {"dense": 1.0, "sparse": 1.0})
    assert gpu.memory_bytes == 24 * 2**30
    assert gpu.link_bandwidth == 3.125e9
    assert (gpu.speed("dense"), gpu.speed("sparse")) == (20, 2.5)
    assert parse_size(1024) == 1024
    assert parse_bandwidth("1Mbit/s") == 125e3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"price_per_hour": -1}, "resource 'cpu-16': `price_per_hour` must be a finite number >= 0, got -1.0"),
        ({"units": 0}, "`units` must be an int >= 1, got 0"),
        ({"device": "tpu"}, "`device` must be one of ['cpu', 'gpu'], got 'tpu'"),
        ({"memory": "lots"}, "`memory` must be a number of bytes or e.g. '24GiB', got 'lots'"),
        ({"link_bandwidth": "10 parsecs/s"}, "`link_bandwidth` must be bytes/s"),
        ({"relative_speed": 0}, "`relative_speed.dense` must be a finite number > 0"),
        ({"relative_speed": {"dense": 2}}, "`relative_speed` needs ['dense', 'sparse']"),
        ({"colour": "red"}, "unknown fields ['colour']"),
    ],
)
def test_bad_catalogue_entries_name_the_resource_the_field_and_what_is_valid(change, message):
    entry = {"name": "cpu-16", "device": "cpu", "price_per_hour": 0.68, "units": 32, "memory": "32GiB"}
    entry["link_bandwidth"] = "10Gbit/s"
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(".", r"\.")):
        load_catalogue({"resources": [{**entry, **change}]})


def test_an_empty_catalogue_or_a_duplicated_name_is_refused():
    with pytest.raises(ValueError, match="non-empty list under `resources`"):
        load_catalogue({"resources": []})
    entry = {"name": "x", "device": "cpu", "price_per_hour": 1, "units": 1, "memory": 1, "link_bandwidth": 1}
    with pytest.raises(ValueError, match=r"\['x'\] appear more than once"):
        load_catalogue({"resources": [entry, entry]})
