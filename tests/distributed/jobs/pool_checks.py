"""Tasks for the pool's own test (tests/distributed/test_pool.py): one changes what a task may change in its
process, one reads it back."""

import os

import torch
import torch.distributed as dist


def change_the_process() -> None:
    """What Lightning's teardown does (``WORLD_SIZE`` deleted) and Accelerate's ``end_training`` does (the process
    group ended), with a directory, a default dtype and a thread count of its own."""
    del os.environ["WORLD_SIZE"]
    os.chdir("/")
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(torch.get_num_threads() + 1)
    dist.barrier()
    dist.destroy_process_group()


def the_process() -> dict:
    """What a task finds: the launcher's variables, the directory, the default dtype, the threads, the group."""
    ones = torch.ones(1)
    dist.all_reduce(ones)  # the group formed anew works
    return {
        "variables": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")},
        "cwd": os.getcwd(),
        "dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "world": dist.get_world_size(),
        "sum": ones.item(),
    }
