"""Remote tables behave as the modules they replace: EmbeddingBag modes, padding, per-sample weights.

One trainer (this process) and embedding servers the strategy starts; each fit is compared with the
same model trained by plain Lightning.
"""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynamix.placement import CostModel, ResourceType, profile_model, solve_dp
from lightning_dynamix.strategies import LayerOffloadStrategy

pytestmark = pytest.mark.distributed

ROWS = 40


class BagModel(LightningModule):
    """A padded embedding, a mean bag with padding, a weighted sum bag with offsets, and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = nn.Embedding(ROWS, 4, padding_idx=0, scale_grad_by_freq=True)
        self.bag = nn.EmbeddingBag(ROWS, 4, mode="mean", padding_idx=1)
        self.weighted = nn.EmbeddingBag(ROWS, 4, mode="sum")
        self.head = nn.Linear(12, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        offsets = torch.arange(0, flat.numel(), ids.shape[1])
        weights = torch.linspace(0.5, 1.5, flat.numel())
        features = [
            self.tokens(ids).mean(1),
            self.bag(ids),
            self.weighted(flat, offsets, per_sample_weights=weights),
        ]
        return self.head(torch.cat(features, 1)).squeeze(1)

    def training_step(self, batch, batch_idx):
        ids, target = batch
        return ((self(ids) - target) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.1)


def data(high: int = ROWS) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, high, (64, 5), generator=generator)
    ids[:, 0] = torch.randint(0, 2, (64,), generator=generator)  # padding rows in every batch
    return DataLoader(TensorDataset(ids, torch.randn(64, generator=generator)), batch_size=16)


def trainer(**kwargs) -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        **kwargs,
    )


def test_bags_padding_and_weights_train_as_in_one_process():
    expected = BagModel()
    served = copy.deepcopy(expected)
    trainer().fit(expected, data())
    trainer(strategy=LayerOffloadStrategy(num_embedding_servers=2)).fit(served, data())
    assert isinstance(served.bag, nn.EmbeddingBag)  # the trained tables came back into the model
    for (name, value), other in zip(served.state_dict().items(), expected.state_dict().values()):
        torch.testing.assert_close(value, other, atol=1e-5, rtol=0, msg=name)
    assert served.tokens.weight[0].abs().sum() == 0  # the padding row never trained


class PrefetchingBagModel(BagModel):
    """BagModel telling the strategy its tables' ids up front (``shift`` moves the bag's ids: a wrong answer)."""

    def __init__(self, shift: int = 0, extra: str | None = None) -> None:
        super().__init__()
        self.shift, self.extra = shift, extra

    def embedding_ids(self, batch):
        ids, _ = batch
        found = {"tokens": ids, "bag": (ids + self.shift) % ROWS, "weighted": ids.reshape(-1)}
        return found if self.extra is None else {**found, self.extra: ids}


class LookupRequests(Callback):
    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.counts.append(trainer.strategy.client.lookup_requests)


def assert_trained_alike(served: LightningModule, expected: LightningModule) -> None:
    for (name, value), other in zip(served.state_dict().items(), expected.state_dict().values()):
        torch.testing.assert_close(value, other, atol=1e-5, rtol=0, msg=name)


def test_tables_named_by_embedding_ids_are_looked_up_in_one_request_per_server():
    expected = BagModel()
    served = PrefetchingBagModel()
    served.load_state_dict(expected.state_dict())
    trainer().fit(expected, data())
    requests = LookupRequests()
    trainer(strategy=LayerOffloadStrategy(num_embedding_servers=2), callbacks=[requests]).fit(served, data())
    assert_trained_alike(served, expected)
    # 3 tables on 2 servers: one request to each server per step, not one per table and server (each
    # step's own sent while the step before ran)
    assert requests.counts[-1] == 2 * 8


def test_embedding_ids_that_miss_cost_a_request_and_a_warning_never_a_wrong_row():
    expected = BagModel()
    served = PrefetchingBagModel(shift=1)
    served.load_state_dict(expected.state_dict())
    trainer().fit(expected, data())
    with pytest.warns(UserWarning, match=r"PrefetchingBagModel.embedding_ids\(batch\) gave a table other ids"):
        trainer(strategy=LayerOffloadStrategy(num_embedding_servers=2)).fit(served, data())
    assert_trained_alike(served, expected)
    wrong = PrefetchingBagModel(extra="head")
    with pytest.raises(ValueError, match=r"names 'head', which is not an embedding module of the model; the offl"):
        trainer(strategy=LayerOffloadStrategy(num_embedding_servers=1)).fit(wrong, data())


def test_embedding_ids_may_name_tables_left_in_the_trainer():
    expected = BagModel()
    served = PrefetchingBagModel()
    served.load_state_dict(expected.state_dict())
    trainer().fit(expected, data())
    requests = LookupRequests()
    strategy = LayerOffloadStrategy(num_embedding_servers=2, offload=["bag", "weighted"])
    trainer(strategy=strategy, callbacks=[requests]).fit(served, data())
    assert_trained_alike(served, expected)
    assert requests.counts[-1] == 2 * 8  # the two offloaded tables, one request per server and step


def test_an_id_outside_a_table_names_the_table_and_the_id():
    model = BagModel()
    with pytest.raises(ValueError, match=r"embedding 'tokens': id \d+ is outside \[0, 40\)"):
        trainer(strategy=LayerOffloadStrategy(offload=["tokens"])).fit(model, data(high=ROWS + 5))
    assert isinstance(model.tokens, nn.Embedding)  # the servers were alive: the table came back


def test_tables_built_on_the_meta_device_are_initialised_by_their_servers():
    with torch.device("meta"):
        big = nn.Embedding(1_000_000, 4, padding_idx=3)
    model = BagModel()
    model.tokens = big
    trainer(strategy=LayerOffloadStrategy(num_embedding_servers=2, offload=["tokens"])).fit(model, data())
    weight = model.tokens.weight
    assert weight.device.type == "cpu"
    assert weight.shape == (1_000_000, 4)
    assert weight[3].abs().sum() == 0
    assert 0.9 < weight[100_000:].std().item() < 1.1  # untouched rows: N(0, 1), as nn.Embedding's own


def test_a_placement_plan_file_chooses_the_tables_and_the_servers(tmp_path):
    model = BagModel()
    ids, target = next(iter(data()))
    profile = profile_model(model, (ids, target), repeats=2, warmup=0)
    cpu = ResourceType("cpu", "cpu", 0.1, 8, 64 * 2**30, 1e10, {"dense": 1.0, "sparse": 1.0})
    gpu = ResourceType("gpu", "gpu", 2.0, 8, 16 * 2**30, 1e10, {"dense": 50.0, "sparse": 0.01})
    plan = solve_dp(CostModel(profile, [cpu, gpu], target_throughput=10.0))
    assert plan.offloaded_layers() == ["tokens", "bag", "weighted"]  # sparse layers are cheap on the CPU type
    plan.save(tmp_path / "plan.json")
    strategy = LayerOffloadStrategy(offload=str(tmp_path / "plan.json"))
    assert strategy.offload == ("tokens", "bag", "weighted")
    assert strategy.num_embedding_servers == plan.embedding_servers()
    expected = copy.deepcopy(model)
    trainer().fit(expected, data())
    trainer(strategy=strategy).fit(model, data())
    for (name, value), other in zip(model.state_dict().items(), expected.state_dict().values()):
        torch.testing.assert_close(value, other, atol=1e-5, rtol=0, msg=name)


def test_a_plan_with_no_table_on_a_cpu_type_or_a_missing_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"plan file .*missing\.json.* does not exist"):
        LayerOffloadStrategy(offload=str(tmp_path / "missing.json"))
    profile = profile_model(BagModel(), next(iter(data())), repeats=1, warmup=0)
    gpu = ResourceType("gpu", "gpu", 2.0, 8, 16 * 2**30, 1e10, {"dense": 50.0, "sparse": 5.0})
    with pytest.raises(ValueError, match="puts no embedding table on a CPU resource type"):
        LayerOffloadStrategy(offload=solve_dp(CostModel(profile, [gpu], 10.0)))
