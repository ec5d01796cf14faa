"""Save one consistent checkpoint when any rank gets a preemption notice (SIGTERM), then stop for a restart.

Spot and preemptible machines get a SIGTERM shortly before they are taken back. With
:class:`PreemptionCheckpoint` among a ``Trainer``'s callbacks, a SIGTERM delivered to any one rank
makes every rank agree, within two step boundaries, to save one checkpoint of the same step
(``<dirpath>/last-preempted.ckpt``) and to exit with
:data:`~lightning_dynamix.elastic.PREEMPTED_EXIT_CODE`, so that the launcher (torch elastic, a SLURM
requeue) restarts the job; ``trainer.fit(model, ckpt_path="last")`` resumes it there, on the same
or another number of ranks.

It replaces Lightning's own SIGTERM handling while training: Lightning's handler broadcasts from
inside the signal handler and only acts on a notice that reaches rank 0.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_dynamix._checks import require_int
from lightning_dynamix.elastic import PREEMPTED_EXIT_CODE, Preempted, PreemptionNotice

log = logging.getLogger(__name__)


class PreemptionCheckpoint(ModelCheckpoint):
    """On a SIGTERM to any rank, every rank saves the same step's checkpoint and the job exits for a restart.

    A ``ModelCheckpoint`` that saves nothing periodically (periodic checkpoints stay the choice of
    your other callbacks), so that ``trainer.fit(..., ckpt_path="last")`` finds its checkpoint. When
    training ends it writes the final state to the same file: a group that the launcher restarts
    after the end (torch elastic does when a node joins while the workers wind down) resumes the end
    and stops, instead of training again from an earlier preemption or from the start.

    Args:
        dirpath: directory of the checkpoint; keep it the same across restarts (the default,
            ``<default_root_dir>/checkpoints``, is; a logger's versioned directory is not).
        check_interval: training batches between two checks (>= 1). Each check starts one
            non-blocking all-reduce of one number and reads the previous check's, so a notice is
            acted on within ``2 * check_interval`` batches of its arrival (plus the checkpoint's write).
        filename: the checkpoint's name without extension; it must contain ``"last"`` for
            ``ckpt_path="last"`` to find it.

    Raises:
        ValueError: for a ``check_interval`` below 1 or a ``filename`` without ``"last"``.
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, check_interval: int = 1, filename: str = "") -> None:
        filename = filename or f"{self.CHECKPOINT_NAME_LAST}-preempted"
        if self.CHECKPOINT_NAME_LAST not in filename:
            raise ValueError(
                f"`filename` must contain {self.CHECKPOINT_NAME_LAST!r} so that ckpt_path='last' finds it,"
                f" got {filename!r}"
            )
        super().__init__(dirpath=dirpath, filename=filename, save_top_k=0, save_last=False)
        self.check_interval = require_int("check_interval", check_interval, 1)
        self.notice = PreemptionNotice()
        self._batches = 0
        self.saved_step: int | None = None
        """The global step this process saved last (at a preemption or at the end), else ``None``."""
        self.seconds_to_save: float | None = None
        """Seconds from this process's notice (or from the agreement, on a rank without one) to the checkpoint saved."""

    @property
    @override
    def state_key(self) -> str:
        return f"PreemptionCheckpoint{{dirpath={self.dirpath!r}}}"

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.dirpath is None:  # stable across restarts, unlike a logger's version directory
            self.dirpath = os.path.join(trainer.default_root_dir, "checkpoints")
        super().setup(trainer, pl_module, stage)

    @property
    def checkpoint_path(self) -> str:
        """Where the preemption checkpoint is written."""
        assert self.dirpath is not None, "PreemptionCheckpoint.setup() has not run"
        return os.path.join(str(self.dirpath), self.filename + self.FILE_EXTENSION)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # after Lightning registered its handlers: while training, a notice is only recorded
        self.notice.install()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        started = self.notice.check(self._batches, self.check_interval, trainer.strategy.root_device)
        if started is None:
            return
        path = self.checkpoint_path
        trainer.save_checkpoint(path)  # every rank: rank 0 writes, then all wait for it
        self.saved_step, self.seconds_to_save = trainer.global_step, time.monotonic() - started
        log.warning(
            "rank %d: preemption notice%s; saved %s at step %d, %.2f s after it; exiting with %d for a restart",
            trainer.global_rank,
            " received" if self.notice.received else " received by another rank",
            path,
            trainer.global_step,
            self.seconds_to_save,
            PREEMPTED_EXIT_CODE,
        )
        raise Preempted(trainer.global_step, path)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.notice.finish()  # every rank started the last poll: let it complete before the group goes
        # the end is a checkpoint too: a launcher that restarts the group after training ended (torch
        # elastic does when a node joins while the workers wind down) must resume the end, not a
        # preemption from earlier in the job (every step since trained twice) or nothing (all of it)
        trainer.save_checkpoint(self.checkpoint_path)
        self.saved_step = trainer.global_step

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.notice.uninstall()
        super().teardown(trainer, pl_module, stage)

    # the periodic saving of ModelCheckpoint is off: save_top_k=0 and no last checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"dirpath": self.dirpath}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass  # nothing to restore: the notice belongs to the run that received it
