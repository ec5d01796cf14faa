"""What the jobs resumed on another number of ranks share (regroup_job.py, fsdp2_regroup_job.py)."""

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
