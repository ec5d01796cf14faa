"""Trains the DLRM example with LayerOffloadStrategy under Lightning's launcher, one scenario per fit.

    python offload_job.py TRAINERS OUT SCENARIO [SCENARIO ...]

A scenario is ``OPTIMIZER-SERVERS-STALENESS`` (``adagrad-2-0``): 2 epochs of 10 steps, batch 16 per
trainer, unshuffled, so the trainers' batches of a step are one contiguous block of samples. Rank 0
writes the whole trained model (the tables come back from the servers at the end) to
``OUT/<scenario>.pt``. ``resume-OPTIMIZER-OLD-NEW``: one epoch on OLD servers with a checkpoint,
then a second Trainer resumes it on NEW servers (``sizes_resume-...``: with per-trainer sizes).
``external-OPTIMIZER-SERVERS-PORT``: the servers were started with ``python -m lightning_dynamix.serve`` at
PORT. ``kill``: server 1 is killed at step 3; the job must fail (with the server pids in ``OUT/kill-pids.txt``).
``bad_push``: 1 server, whose step protocol trainer 0 breaks at step 3 (:class:`BadPush`), under a process-group
(and RPC) timeout of 10 minutes; the job must fail with the server's error long before that.

With HeterogeneousLayerOffloadStrategy (a batch size per trainer, the global batch kept at 16 per trainer, so
the same batches as above): ``sizes-OPTIMIZER-SERVERS`` resizes the trainers at set steps, a trainer sitting
steps out among them (``SIZES``); ``balance-OPTIMIZER-SERVERS``: DynamixCallback's PID controller balances
trainer 1 made 4 times slower on a virtual clock. Both write every rank's lookups and the sizes it trained.

``overflow-OPTIMIZER-SERVERS``: fp16 mixed precision with a GradScaler; at step 3 the rows' gradients of trainer 0
alone are made inf (the dense ones stay finite). Every rank writes its scale and its dense parameters to
``OUT/<scenario>-rank<R>.pt``.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
from datetime import timedelta
from math import inf
from pathlib import Path

import torch
import torch.distributed.rpc as rpc
from lightning.pytorch import Callback, LightningDataModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, DistributedSampler

from lightning_dynamix.callbacks import DynamixCallback
from lightning_dynamix.data import CTRSpec, SyntheticCTRDataset
from lightning_dynamix.offload.embedding_server import remote_push, server_name
from lightning_dynamix.strategies import HeterogeneousLayerOffloadStrategy, LayerOffloadStrategy

ROOT = Path(__file__).resolve().parents[3]
TABLE_SIZES = (50, 200, 1000, 7, 3000)
BATCH, STEPS_PER_EPOCH, EPOCHS = 16, 10, 2
LR = {"sgd": 0.5, "adagrad": 0.05}
# sizes-*: the trainers' sizes set after so many steps (from the first step not read yet); 0 sits a step out
SIZES = {0: [24, 8], 3: [8, 24], 6: [32, 0], 8: [0, 32], 9: [32, 0], 12: [20, 12]}


def load_dlrm():
    spec = importlib.util.spec_from_file_location("examples_ctr_dlrm", ROOT / "examples" / "ctr" / "dlrm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def make_model(optimizer: str):
    dlrm = load_dlrm()
    return dlrm.DLRM(
        num_dense=13, table_sizes=TABLE_SIZES, embedding_dim=8, bottom_mlp=(16,), top_mlp=(16,),
        optimizer=optimizer, lr=LR[optimizer], seed=0,
    )  # fmt: skip


def make_dataset(trainers: int) -> SyntheticCTRDataset:
    return SyntheticCTRDataset(STEPS_PER_EPOCH * BATCH * trainers, CTRSpec(table_sizes=TABLE_SIZES, seed=1))


class UnshuffledData(LightningDataModule):
    """Trainer ``r`` of ``n`` takes samples ``r, r + n, ...`` in order (Lightning's own sampler shuffles)."""

    def __init__(self, trainers: int) -> None:
        super().__init__()
        self.dataset = make_dataset(trainers)

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(
            self.dataset, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return DataLoader(self.dataset, batch_size=BATCH, sampler=sampler)


class KillServer(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        servers = trainer.strategy.embedding_offload.servers
        if trainer.global_step == 3 and servers:
            (self.out / "kill-pids.txt").write_text(" ".join(str(s.pid) for s in servers))
            servers[1].send_signal(signal.SIGKILL)
            servers[1].wait()


class BadPush(Callback):
    """At step 3, trainer 0 pushes the step's gradients of its first table as float16 (the table is float32) ahead of
    its own push: a push the server refuses, which fails it for every trainer."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 3 and trainer.global_rank == 0:
            step = trainer.strategy.client.step
            grads = {"embeddings.0": (torch.tensor([0]), torch.zeros(1, 8, dtype=torch.float16))}
            rpc.rpc_async(server_name(0), remote_push, args=(0, step, grads, 1.0))


class LookupCounts(Callback):
    """What the trainer's lookups did: prefetches for later steps (pipelined), misses, requests; and, with
    per-trainer sizes, the sizes of every step trained."""

    def __init__(self) -> None:
        self.sizes = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        current = getattr(trainer.strategy, "current_batch_sizes", None)
        if current is not None:
            self.sizes.append(list(current))

    def on_train_end(self, trainer, pl_module) -> None:
        client = trainer.strategy.client
        self.counts = {
            "ahead": client.prefetches_ahead,
            "misses": client.prefetch_misses,
            "requests": client.lookup_requests,
            "sizes": self.sizes,
        }


class Resize(Callback):
    """Sets :data:`SIZES` on every trainer (a collective) after as many steps as their key."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sizes = SIZES.get(trainer.global_step)
        if sizes is not None and trainer.global_step:
            trainer.strategy.set_batch_sizes(sizes)


class RowsOverflow(Callback):
    """At step 3, trainer 0's first table passes an inf gradient to its rows: the loss and the dense gradients
    stay finite, as where only the embeddings' gradient overflows."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.handle = None
        if trainer.global_step == 3 and trainer.global_rank == 0:
            self.handle = pl_module.embeddings[0].register_forward_hook(self.overflow)

    @staticmethod
    def overflow(module, inputs, output) -> None:
        output.register_hook(lambda grad: grad * inf)  # the rows' gradient only: the output is left as it is

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.handle is not None:
            self.handle.remove()


def fit(trainers: int, optimizer: str, servers: int, staleness: int, epochs: int, out: Path, **kwargs):
    callbacks = kwargs.pop("callbacks", [])
    ckpt_path = kwargs.pop("ckpt_path", None)
    plugins = kwargs.pop("plugins", None)
    strategy = HeterogeneousLayerOffloadStrategy if "batch_sizes" in kwargs else LayerOffloadStrategy
    model = make_model(optimizer)
    trainer = Trainer(
        accelerator="cpu",
        devices=trainers,
        strategy=strategy(num_embedding_servers=servers, staleness=staleness, **kwargs),
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=bool([c for c in callbacks if isinstance(c, ModelCheckpoint)]),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        plugins=plugins,
        default_root_dir=out,
        use_distributed_sampler=False,
    )
    trainer.fit(model, datamodule=UnshuffledData(trainers), ckpt_path=ckpt_path)
    return trainer, model


def main() -> None:
    trainers, out = int(sys.argv[1]), Path(sys.argv[2])
    for scenario in sys.argv[3:]:
        if scenario == "kill":
            fit(trainers, "sgd", 2, 0, EPOCHS, out, callbacks=[KillServer(out)])
            continue
        if scenario == "bad_push":
            fit(trainers, "sgd", 1, 0, EPOCHS, out, callbacks=[BadPush()], timeout=timedelta(minutes=10))
            continue
        if scenario.startswith("external-"):
            _, optimizer, servers, port = scenario.split("-")
            kwargs = {"launch_servers": False, "server_port": int(port)}
            trainer, model = fit(trainers, optimizer, int(servers), 0, EPOCHS, out, **kwargs)
        elif scenario.startswith(("sizes-", "balance-")):
            kind, optimizer, servers = scenario.split("-")
            counts = LookupCounts()
            if kind == "sizes":
                callbacks, kwargs = [Resize(), counts], {"batch_sizes": SIZES[0], "min_batch_size": 0}
            else:
                dynamix = DynamixCallback("pid", interval=3, warmup_steps=2, gradient_noise_scale=False)
                # trainer 1 computes 4x slower on a virtual clock: pid decides the same on every run
                from common import VirtualCompute  # the jobs' folder: on the path where this runs as a script

                callbacks = [VirtualCompute(1e-3, [[0, 1, 4.0]]), dynamix, counts]
                kwargs = {"batch_sizes": [BATCH] * trainers, "min_batch_size": 4}
            trainer, model = fit(
                trainers, optimizer, int(servers), 0, EPOCHS, out, callbacks=callbacks, shuffle=False, **kwargs
            )
            (out / f"{scenario}-rank{trainer.global_rank}.json").write_text(json.dumps(counts.counts))
        elif scenario.startswith("overflow-"):
            _, optimizer, servers = scenario.split("-")
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
            plugins = [MixedPrecision("16-mixed", "cpu", scaler)]
            trainer, model = fit(
                trainers, optimizer, int(servers), 0, EPOCHS, out, callbacks=[RowsOverflow()], plugins=plugins
            )
            dense = {k: v for k, v in model.state_dict().items() if not k.startswith("embeddings.")}
            torch.save({"scale": scaler.get_scale(), "dense": dense}, out / f"{scenario}-rank{trainer.global_rank}.pt")
        elif scenario.startswith(("resume-", "sizes_resume-")):
            kind, optimizer, old, new = scenario.split("-")
            # sizes_resume: per-trainer sizes (the resumed run's own would be others: the checkpoint's hold)
            sizes = {"shuffle": False, "batch_sizes": SIZES[0]} if kind == "sizes_resume" else {}
            resumed = {**sizes, "batch_sizes": [16, 16]} if sizes else {}
            checkpoints = out / scenario
            callbacks = [ModelCheckpoint(checkpoints, save_top_k=-1)]
            fit(trainers, optimizer, int(old), 0, 1, out, callbacks=callbacks, **sizes)
            (ckpt,) = checkpoints.glob("*.ckpt")
            counts = LookupCounts()
            trainer, model = fit(
                trainers, optimizer, int(new), 0, EPOCHS, out, ckpt_path=ckpt, callbacks=[counts], **resumed
            )
            if sizes:
                (out / f"{scenario}-rank{trainer.global_rank}.json").write_text(json.dumps(counts.counts))
        else:  # optimizer-servers-staleness[-depth]
            optimizer, servers, staleness, *depth = scenario.split("-")
            counts = LookupCounts()
            kwargs = {"prefetch_depth": int(depth[0])} if depth else {}
            trainer, model = fit(
                trainers, optimizer, int(servers), int(staleness), EPOCHS, out, callbacks=[counts], **kwargs
            )
            (out / f"{scenario}-rank{trainer.global_rank}.json").write_text(json.dumps(counts.counts))
        if trainer.global_rank == 0:
            assert trainer.global_step == STEPS_PER_EPOCH * EPOCHS, trainer.global_step
            torch.save(model.state_dict(), out / f"{scenario}.pt")


if __name__ == "__main__":
    main()
