"""Distributed pieces free of Lightning: the weighted all-reduce hook, its weights, collectives."""

from lightning_dynamix.distributed.collectives import (
    broadcast_floats,
    gather_floats,
    gather_ints,
    let_backend_threads_finish,
    mean_by_counts_all_reduce,
    set_batch_sizes_on_every_rank,
)
from lightning_dynamix.distributed.comm_hooks import BucketNorms, WeightedAllReduceState, weighted_allreduce_hook
from lightning_dynamix.distributed.launching import JOB_VARIABLES, free_port, job_environment
from lightning_dynamix.distributed.sit_out import (
    MAX_TRAINING_GROUPS,
    StaleRanks,
    TrainingRanksGroups,
    broadcast_training_state,
    can_leave_gradient_sync,
    training_ranks_groups,
    zero_gradient_loss,
)
from lightning_dynamix.distributed.weighting import (
    LossReduction,
    SyncWindowWeighting,
    report_gradient_norms,
    validate_loss_reduction,
)

__all__ = [
    "JOB_VARIABLES",
    "MAX_TRAINING_GROUPS",
    "BucketNorms",
    "LossReduction",
    "StaleRanks",
    "SyncWindowWeighting",
    "TrainingRanksGroups",
    "WeightedAllReduceState",
    "broadcast_floats",
    "broadcast_training_state",
    "can_leave_gradient_sync",
    "free_port",
    "gather_floats",
    "gather_ints",
    "job_environment",
    "let_backend_threads_finish",
    "mean_by_counts_all_reduce",
    "report_gradient_norms",
    "set_batch_sizes_on_every_rank",
    "training_ranks_groups",
    "validate_loss_reduction",
    "weighted_allreduce_hook",
    "zero_gradient_loss",
]
