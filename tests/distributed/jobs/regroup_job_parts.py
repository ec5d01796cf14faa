"""What the jobs resumed on another number of ranks share (regroup_job.py, fsdp2_regroup_job.py)."""

from common import REGROUP_PLAN as PLAN
from common import uneven
from lightning.pytorch import Callback

from lightning_dynamix.callbacks import DynamixCallback


class ControllerProbe(Callback):
    """Records, as training starts (after a resume), what DynamixCallback carried over to this group."""

    def __init__(self, dynamix: DynamixCallback) -> None:
        self.dynamix = dynamix
        self.seen: dict = {}

    def on_train_start(self, trainer, pl_module):
        maker = self.dynamix.maker
        self.seen = {
            "machine_ids": maker.machine_ids,
            "regrouped_from": maker.regrouped_from,
            "speeds": maker.controller.rank_speeds(),
            "batch_sizes": list(trainer.strategy.batch_sizes),
        }


class TotalResizer(Callback):
    """Sets the global batch of ``REGROUP_PLAN`` at its steps, split over this launch's ranks by ``uneven``."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        total = PLAN.get((trainer.current_epoch, batch_idx))
        if batch_idx == trainer.num_training_batches - 1:
            total = total or PLAN.get((trainer.current_epoch, -1))
        if total is not None:
            trainer.strategy.set_batch_sizes(uneven(total, trainer.world_size))
