"""LayerOffloadStrategy's arguments and the models it refuses, each with a message that says what to do."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynamix.offload import RowAdagrad, RowSGD, sparse_counterpart
from lightning_dynamix.strategies import HeterogeneousLayerOffloadStrategy, LayerOffloadStrategy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_embedding_servers": 0}, "`num_embedding_servers` must be an int >= 1, got 0"),
        ({"sparse_optimizer": "adam"}, "`sparse_optimizer` must be one of ['adagrad', 'sgd']"),
        ({"sparse_optimizer": "sgd", "sparse_optimizer_args": {"momentum": 0.9}}, "bad arguments"),
        ({"sparse_optimizer_args": {"lr": 0.1}}, "without a `sparse_optimizer`"),
        ({"staleness": -1}, "`staleness` must be an int >= 0, got -1"),
        ({"prefetch_depth": -1}, "`prefetch_depth` must be an int >= 0, got -1"),
        ({"trainer_threads": 0}, "`trainer_threads` must be an int >= 1, got 0"),
        ({"offload": "embeddings"}, "`offload` must be 'auto' or a non-empty list"),
        ({"offload": []}, "`offload` must be 'auto' or a non-empty list"),
        ({"offload": ["a", "a"]}, "distinct module names"),
        ({"launch_servers": False}, "`server_port` is required with launch_servers=False"),
        ({"server_port": 70000}, "HOST:PORT"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        LayerOffloadStrategy(**kwargs)


def test_bad_arguments_of_either_half_are_refused_by_the_heterogeneous_strategy_too():
    with pytest.raises(ValueError, match="`staleness` must be an int >= 0, got -1"):
        HeterogeneousLayerOffloadStrategy(staleness=-1)
    with pytest.raises(ValueError, match="batch_sizes"):
        HeterogeneousLayerOffloadStrategy(batch_sizes=[4, "8"])
    with pytest.raises(ValueError, match="`ddp_comm_hook` is not supported"):
        HeterogeneousLayerOffloadStrategy(ddp_comm_hook=lambda state, bucket: None)


@pytest.mark.parametrize(
    ("name", "kind"),
    [("layer_offload", LayerOffloadStrategy), ("heterogeneous_layer_offload", HeterogeneousLayerOffloadStrategy)],
)
def test_the_strategies_are_registered_by_name(name, kind):
    trainer = Trainer(strategy=name, accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is kind


def test_sparse_counterpart_mirrors_sgd_and_adagrad_and_refuses_the_rest():
    weight = nn.Parameter(torch.zeros(2))
    assert vars(sparse_counterpart(torch.optim.SGD([weight], lr=0.3))) == vars(RowSGD(lr=0.3))
    adagrad = torch.optim.Adagrad([weight], lr=0.2, lr_decay=0.1, initial_accumulator_value=0.5, eps=1e-8)
    assert vars(sparse_counterpart(adagrad)) == vars(RowAdagrad(0.2, 0.1, 0.5, 1e-8))
    with pytest.raises(ValueError, match="momentum"):
        sparse_counterpart(torch.optim.SGD([weight], lr=0.3, momentum=0.9))
    with pytest.raises(ValueError, match="Adam, which has no sparse counterpart"):
        sparse_counterpart(torch.optim.Adam([weight]))


class Model(LightningModule):
    def __init__(self, tied: bool = False, max_norm: float | None = None) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 4, max_norm=max_norm)
        self.head = nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.table.weight

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.head(self.table(ids)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def unused_port() -> int:
    """A port nothing on this machine listens at."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fit(
    model: LightningModule,
    loader: DataLoader | None = None,
    strategy: type[LayerOffloadStrategy] | str = LayerOffloadStrategy,
    max_steps: int = 1,
    accumulate_grad_batches: int = 1,
    plugins: list[Any] | None = None,
    callbacks: list[Any] | None = None,
    **kwargs,
) -> Any:
    """``model`` trained by a Trainer with ``strategy`` (a class, given ``kwargs``, or a name); its strategy."""
    trainer = Trainer(
        strategy=strategy if isinstance(strategy, str) else strategy(**kwargs),
        plugins=plugins,
        callbacks=callbacks,
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate_grad_batches,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    try:
        trainer.fit(model, loader or DataLoader(TensorDataset(torch.arange(10)), batch_size=5))
    finally:
        offload = getattr(trainer.strategy, "embedding_offload", None)  # None: plain Lightning, for comparison
        assert offload is None or not offload.servers  # stopped, or never started
    return trainer.strategy


@pytest.mark.parametrize(
    ("model", "kwargs", "message"),
    [
        (Model(), {"offload": ["tabel"]}, "`offload` names 'tabel', which is not a module of Model; its embedding"),
        (Model(), {"offload": ["head"]}, "`offload` names 'head', a Linear; only nn.Embedding and nn.EmbeddingBag"),
        (Model(tied=True), {}, "the weights of ['table'] are also used by other modules"),
        (Model(max_norm=1.0), {}, "has max_norm=1.0"),
    ],
)
def test_models_that_cannot_be_offloaded_are_refused_before_any_server_starts(model, kwargs, message):
    with pytest.raises(MisconfigurationException, match=message.replace("[", r"\[").replace("]", r"\]")):
        fit(model, **kwargs)


@pytest.mark.e2e
def test_reading_ahead_is_refused_where_it_cannot_work_and_left_off_by_default():
    class WithIds(Model):
        def embedding_ids(self, batch):
            return {"table": batch[0]}

    # what the model or the Trainer rules out is refused before the trainer waits for a server: here none
    # is started or listening, so a refusal after the strategy began to wait would be a timeout instead
    no_servers = {"launch_servers": False, "server_port": unused_port(), "timeout": timedelta(seconds=5)}
    # no embedding_ids: the strategy cannot know a batch's ids before its forward
    with pytest.raises(MisconfigurationException, match=r"`prefetch_depth=1` .* Model defines no `embedding_ids"):
        fit(Model(), prefetch_depth=1, **no_servers)
    # several batches per optimizer step: a batch read ahead would be asked for as the next step's (its
    # answer dropped unused where the step's second batch is read)
    with pytest.raises(MisconfigurationException, match=r"accumulate_grad_batches=2 trains several batches"):
        fit(WithIds(), prefetch_depth=1, accumulate_grad_batches=2, **no_servers)
    fit(Model())  # unset: each step is looked up when it starts

    class CountingSampler(torch.utils.data.BatchSampler):  # keeps a state of what it handed out
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    sampler = CountingSampler(torch.utils.data.SequentialSampler(range(10)), 5, drop_last=False)
    loader = DataLoader(TensorDataset(torch.arange(10)), batch_sampler=sampler)
    with pytest.raises(MisconfigurationException, match=r"CountingSampler keeps a state of the batches it handed"):
        fit(WithIds(), loader, prefetch_depth=1)  # the dataloader is known once the servers run

    class Lookups(Callback):
        def on_train_end(self, trainer, pl_module):
            self.ahead, self.requests = (
                trainer.strategy.client.prefetches_ahead,
                trainer.strategy.client.lookup_requests,
            )

    lookups, loader = Lookups(), DataLoader(TensorDataset(torch.arange(20) % 10), batch_size=2)
    fit(WithIds(), loader, max_steps=4, accumulate_grad_batches=2, callbacks=[lookups])
    assert (lookups.ahead, lookups.requests) == (0, 8)  # unset: left off, one request per batch
    # the heterogeneous strategy's own DataLoader counts the batches it hands out, not those read ahead
    loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=2)
    strategy = fit(WithIds(), loader, strategy=HeterogeneousLayerOffloadStrategy, max_steps=2, prefetch_depth=1)
    sampler = strategy.train_batch_sampler
    assert (sampler._produced, sampler.state_dict()["step"]) == (3, 2)  # a resumed run trains the third batch read


@pytest.mark.e2e
def test_servers_that_never_come_fail_the_fit_after_the_strategy_s_timeout_with_how_to_start_them():
    port = unused_port()  # no server listens there, and none is started
    message = (
        rf"trainer-0: the job's 2 embedding server\(s\) and 1 trainer\(s\) did not all meet at \S+:{port} within the"
        rf" strategy's timeout of 2 s: start them with `python -m lightning_dynamix.serve --address \S+:{port}"
        r" --server-rank S --num-servers 2 --num-trainers 1`"
    )
    with pytest.raises(RuntimeError, match=message):  # not torch's 30 minutes
        fit(Model(), launch_servers=False, server_port=port, num_embedding_servers=2, timeout=timedelta(seconds=2))


def test_heterogeneous_trainer_sizes_are_one_per_trainer_rank_checked_before_any_server_starts():
    with pytest.raises(MisconfigurationException, match=r"`batch_sizes` \[6, 4\] gives 2 trainer ranks a size, but"
                       r" the Trainer has 1"):  # fmt: skip
        fit(Model(), strategy=HeterogeneousLayerOffloadStrategy, batch_sizes=[6, 4])


@pytest.mark.distributed  # it starts embedding servers
def test_a_trainer_leaves_a_core_to_each_server_it_launched_and_gets_its_threads_back():
    # a trainer's idle intra-op threads spin on the cores its servers need to answer it
    seen = []

    class Threads(Model):
        def training_step(self, batch, batch_idx):
            seen.append(torch.get_num_threads())
            return super().training_step(batch, batch_idx)

    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    fit(Threads(), num_embedding_servers=2)
    assert seen == [min(before, max(1, cores - 2))]
    assert torch.get_num_threads() == before
    fit(Threads(), trainer_threads=3)  # chosen: exactly that
    assert seen[-1] == 3
    assert torch.get_num_threads() == before


@pytest.mark.distributed  # it starts embedding servers
def test_the_servers_a_fit_started_are_gone_when_it_returns(capfd):
    pids = []

    class Servers(Callback):
        def on_train_start(self, trainer, pl_module):
            pids.extend(server.pid for server in trainer.strategy.embedding_offload.servers)

    fit(Model(), num_embedding_servers=2, callbacks=[Servers()])
    assert len(pids) == 2
    for pid in pids:  # stopped and reaped, not left to exit on their own
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # torch's RPC logs the connections closed at the end as errors, though none is: not the servers
    assert "RPC agent for embedding-server" not in capfd.readouterr().err


def test_a_model_without_embeddings_is_refused():
    class Dense(Model):
        def __init__(self):
            super().__init__()
            self.table = nn.Identity()

    with pytest.raises(MisconfigurationException, match=r"found no nn\.Embedding or nn\.EmbeddingBag in Dense"):
        fit(Dense())


@pytest.mark.distributed  # its fit starts embedding servers
def test_an_optimizer_without_a_sparse_counterpart_is_refused_and_the_model_keeps_its_table():
    class WithAdam(Model):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters())

    model = WithAdam()
    before = model.table.weight.detach().clone()
    with pytest.raises(MisconfigurationException, match=r"Adam, which has no sparse counterpart.*sparse_optimizer"):
        fit(model)
    assert isinstance(model.table, nn.Embedding)
    torch.testing.assert_close(model.table.weight.detach(), before)


@pytest.mark.distributed  # its fit starts embedding servers
@pytest.mark.parametrize("init_scale", [1024.0, 2.0**22])  # 2**22: the first steps overflow in fp16, skipped
def test_fp16_mixed_precision_with_a_grad_scaler_trains_the_tables_as_plain_lightning_does(init_scale):
    # the scaler multiplies the loss, and so the rows' gradients; it skips a step with inf or NaN gradients
    class Half(Model):
        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return self.head(self.table(ids)).float().pow(2).mean()

    def train(strategy: type[LayerOffloadStrategy] | str) -> tuple[dict[str, torch.Tensor], float]:
        torch.manual_seed(0)
        model, scaler = Half(), torch.amp.GradScaler("cpu", init_scale=init_scale)
        fit(model, strategy=strategy, max_steps=10, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, scaler.get_scale()

    expected, scale = train("auto")
    result, offloaded_scale = train(LayerOffloadStrategy)
    assert offloaded_scale == scale
    if init_scale > 1024:
        assert scale < init_scale  # some steps were skipped: the scale backed off
    torch.manual_seed(0)
    assert (expected["table.weight"] - Half().table.weight.detach()).abs().max() > 1e-3  # the table trained
    for name, tensor in expected.items():
        torch.testing.assert_close(result[name], tensor, rtol=0, atol=1e-6)


@pytest.mark.distributed  # its fit starts embedding servers
def test_an_overflow_in_the_rows_gradients_alone_skips_the_step_as_plain_lightning_does():
    # at step 3 the loss's term on the embeddings overflows their gradient (and so, in one process, the
    # table's), while the dense layer's gradient stays finite: the scaler must still skip the step
    class Overflow(Model):
        def training_step(self, batch, batch_idx):
            (ids,) = batch
            embedded = self.table(ids)
            loss = self.head(embedded).float().pow(2).mean()
            return loss + embedded.sum() * 1e38 if self.global_step == 3 else loss

    def train(strategy: type[LayerOffloadStrategy] | str) -> tuple[dict[str, torch.Tensor], float]:
        torch.manual_seed(0)
        model, scaler = Overflow(), torch.amp.GradScaler("cpu", init_scale=1024.0)
        fit(model, strategy=strategy, max_steps=6, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, scaler.get_scale()

    expected, scale = train("auto")
    assert scale == 512.0  # plain Lightning skipped that one step and backed off
    result, offloaded_scale = train(LayerOffloadStrategy)
    assert offloaded_scale == scale
    assert torch.isfinite(result["table.weight"]).all()
    for name, tensor in expected.items():
        torch.testing.assert_close(result[name], tensor, rtol=0, atol=1e-6)


@pytest.mark.distributed  # its fit starts embedding servers
@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
def test_a_true_precision_gives_the_offloaded_tables_the_dtype_it_gives_the_model_as_plain_lightning_does(precision):
    # the plugin converts the model in DDP's set-up, when the tables are already out of it: they must come
    # out of the servers in the dtype they have in plain Lightning, trained as there
    dtype = {"64-true": torch.float64, "bf16-true": torch.bfloat16}[precision]

    def train(strategy: type[LayerOffloadStrategy] | str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = Model()
        plugin = DoublePrecision() if precision == "64-true" else HalfPrecision(precision)
        fit(model, strategy=strategy, max_steps=4, plugins=[plugin], timeout=timedelta(seconds=60))
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    expected = train("auto")
    assert expected["table.weight"].dtype == dtype
    result = train(LayerOffloadStrategy)
    # bfloat16: the servers round a row's change before adding it, torch's SGD rounds the sum only; each of the
    # 4 updates may leave a value a unit in its last place away (relative, and one unit at 1 near 0)
    unit = torch.finfo(dtype).eps
    rtol, atol = (4 * unit, unit) if dtype == torch.bfloat16 else (0.0, 1e-12)
    for name, tensor in expected.items():
        assert result[name].dtype == tensor.dtype, name
        torch.testing.assert_close(result[name], tensor, rtol=rtol, atol=atol)
