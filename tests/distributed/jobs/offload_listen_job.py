"""One trainer of LayerOffloadStrategy whose launched server's listening sockets it writes down.

    python offload_listen_job.py OUT

Rank 0 (the only trainer) meets its server at ``MASTER_ADDR`` (the job's address, the host's own on its link
where the test runs it on a host); at its first step it writes, as JSON to OUT, the addresses every server
process of the strategy listens on and the job's address.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import psutil
from lightning.pytorch import Callback, Trainer

from lightning_dynamix.data import CTRDataModule
from lightning_dynamix.data.dlrm import DLRM
from lightning_dynamix.strategies import LayerOffloadStrategy


class Listening(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx:
            return
        servers = trainer.strategy.embedding_offload.servers
        listening = [
            f"{c.laddr.ip}:{c.laddr.port}"
            for s in servers
            for c in psutil.Process(s.pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN
        ]
        self.out.write_text(json.dumps({"job": os.environ["MASTER_ADDR"], "servers": listening}))


def main(out: Path) -> None:
    tables = (20, 30)
    data = CTRDataModule(num_samples=64, num_val_samples=16, batch_size=16, table_sizes=tables, num_dense=4)
    model = DLRM(num_dense=4, table_sizes=tables, embedding_dim=4, bottom_mlp=(8,), top_mlp=(8,))
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=LayerOffloadStrategy(num_embedding_servers=1), max_steps=2,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Listening(out)],
    )  # fmt: skip
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
