"""The two layer-offload strategies are Lightning strategies holding one offload part, built as users build them."""

from __future__ import annotations

import copy
import inspect
import pickle
import sys

import pytest
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy

from lightning_dynamix.strategies import (
    HeterogeneousDDPStrategy,
    HeterogeneousLayerOffloadStrategy,
    LayerOffloadStrategy,
)
from lightning_dynamix.strategies.layer_offload import EmbeddingOffload
from lightning_dynamix.strategies.layer_offload.embedding_offload import OFFLOAD_ARGUMENTS

OFFLOAD = {"num_embedding_servers": 3, "offload": ["table"], "sparse_optimizer": "adagrad", "staleness": 1}


def test_each_strategy_holds_an_offload_part_and_neither_inherits_the_other():
    assert issubclass(LayerOffloadStrategy, DDPStrategy)
    assert issubclass(HeterogeneousLayerOffloadStrategy, HeterogeneousDDPStrategy)
    assert not issubclass(HeterogeneousLayerOffloadStrategy, LayerOffloadStrategy)
    assert not issubclass(LayerOffloadStrategy, HeterogeneousDDPStrategy)
    for kind in (LayerOffloadStrategy, HeterogeneousLayerOffloadStrategy):
        strategy = kind(**OFFLOAD)
        assert isinstance(strategy.embedding_offload, EmbeddingOffload)
        for name, value in OFFLOAD.items():  # the part's arguments read as the strategy's own
            expected = tuple(value) if name == "offload" else value
            assert getattr(strategy, name) == getattr(strategy.embedding_offload, name) == expected
        assert strategy.client is None  # no servers before set-up


def test_both_strategies_take_the_offload_arguments_by_name_with_the_same_defaults():
    offload = inspect.signature(EmbeddingOffload).parameters
    for kind in (LayerOffloadStrategy, HeterogeneousLayerOffloadStrategy):
        parameters = inspect.signature(kind).parameters  # what help() and LightningCLI read
        for name in OFFLOAD_ARGUMENTS:
            assert parameters[name].default == offload[name].default, (kind.__name__, name)
    heterogeneous = inspect.signature(HeterogeneousLayerOffloadStrategy).parameters
    for name, parameter in inspect.signature(HeterogeneousDDPStrategy).parameters.items():
        if parameter.kind is not inspect.Parameter.VAR_KEYWORD:
            assert heterogeneous[name].default == parameter.default, name
    strategy = HeterogeneousLayerOffloadStrategy([4], min_batch_size=0, process_group_backend="gloo", **OFFLOAD)
    assert (strategy.min_batch_size, strategy.process_group_backend, strategy.staleness) == (0, "gloo", 1)


@pytest.mark.parametrize("kind", [LayerOffloadStrategy, HeterogeneousLayerOffloadStrategy])
def test_a_strategy_pickles_and_copies_with_its_offload_arguments(kind):
    strategy = kind(**OFFLOAD)
    for copied in (pickle.loads(pickle.dumps(strategy)), copy.deepcopy(strategy)):
        assert copied.embedding_offload is not strategy.embedding_offload
        assert [getattr(copied, name) for name in OFFLOAD] == [getattr(strategy, name) for name in OFFLOAD]


@pytest.mark.parametrize("kind", [LayerOffloadStrategy, HeterogeneousLayerOffloadStrategy])
def test_lightning_cli_builds_a_strategy_from_init_args(kind, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])  # the arguments are `args`, as from a YAML file
    init_args = {"num_embedding_servers": 2, "offload": "auto", "staleness": 1, "process_group_backend": "gloo"}
    if kind is HeterogeneousLayerOffloadStrategy:
        init_args |= {"batch_sizes": [128], "min_batch_size": 16}
    strategy = {"class_path": f"lightning_dynamix.strategies.{kind.__name__}", "init_args": init_args}
    trainer = {"accelerator": "cpu", "devices": 1, "logger": False, "strategy": strategy}
    cli = LightningCLI(BoringModel, run=False, args={"trainer": trainer}, save_config_callback=None)
    built = cli.trainer.strategy
    assert type(built) is kind
    assert (built.num_embedding_servers, built.staleness, built.process_group_backend) == (2, 1, "gloo")
    if kind is HeterogeneousLayerOffloadStrategy:
        assert (list(built.batch_sizes), built.min_batch_size) == ([128], 16)
