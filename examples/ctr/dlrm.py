"""DLRM, the deep learning recommendation model, trained on the built-in synthetic CTR data.

    python examples/ctr/dlrm.py fit --config examples/ctr/dlrm.yaml
    python examples/ctr/dlrm.py fit --config examples/ctr/dlrm_offload.yaml

The second config trains the same model with its embedding tables on CPU embedding servers
(LayerOffloadStrategy). The model is :class:`lightning_dynamix.data.dlrm.DLRM`. The data's
``num_dense`` and ``table_sizes`` are linked to the model's, so the embedding tables always match
the categorical features (set them under ``data:`` only).
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from lightning_dynamix.data import CTRDataModule
from lightning_dynamix.data.dlrm import DLRM

__all__ = ["DLRM", "DLRMCLI"]


class DLRMCLI(LightningCLI):
    """The Lightning CLI with the model's feature counts taken from the data."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_dense", "model.num_dense")
        parser.link_arguments("data.table_sizes", "model.table_sizes")


if __name__ == "__main__":
    DLRMCLI(DLRM, CTRDataModule)
