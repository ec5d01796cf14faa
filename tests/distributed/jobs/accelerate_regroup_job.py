"""DynamixAccelerate states saved by one number of processes and loaded by another (3 -> 2 and 2 -> 3).

Usage: torchrun --standalone --nproc_per_node W accelerate_regroup_job.py OUT_DIR [RESUME_FROM_W]

For SGD without DataLoader workers and Adam with 2 workers, each with a fresh Accelerator: with
RESUME_FROM_W, first ``load_state`` the states that launch saved and train to the end of epoch 1
("resume-mid", "resume-end"); then, unless this launch is the last one, train straight through
("full"), and stop after a ``save_state`` at optimizer step 5 ("mid") and at the end of epoch 0
("end"); the first 3-process launch ends with "preempt" (process 2 sends itself SIGTERM after
optimizer step 6; every process saves the state and exits with 143), which the 2-process launch
resumes, saving its end there with ``dynamix.finish()``, and loads once more ("after-end": nothing
left to train). Sizes change at planned steps by global batch, split over this launch's processes.
Every process saves the batches it trained on and the final parameters.
"""

import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from common import REGROUP_PLAN as PLAN
from common import IndexedDataset, make_network, make_optimizer, uneven
from torch.utils.data import DataLoader

from lightning_dynamix.elastic import Preempted
from lightning_dynamix.integrations.accelerate import DynamixAccelerate

out = Path(sys.argv[1])
resume_from = int(sys.argv[2]) if len(sys.argv) > 2 else None
CONFIGS = {"sgd-workers0": ("sgd", 0), "adam-workers2": ("adam", 2)}
MID_STEP = 5
PREEMPT_AFTER = 6


def train(config: str, run: str, state_dir: Path | None = None) -> None:
    optimizer_name, workers = CONFIGS[config]
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    world = accelerator.num_processes
    preempt = out / f"{config}-preempt-w{world}" if run == "preempt" else None
    if run == "resume-preempt-from3":  # the job keeps saving where it resumed from, the end included
        preempt = state_dir
    dynamix = DynamixAccelerate(accelerator, seed=5, save_on_preemption=preempt)
    network = make_network(0)
    optimizer = make_optimizer(optimizer_name, network.parameters())
    loader = DataLoader(IndexedDataset(150), batch_size=4, num_workers=workers)
    model, optimizer, loader = dynamix.prepare(network, optimizer, loader)
    if state_dir is not None:
        accelerator.load_state(str(state_dir))
    steps, stop = [], False
    for epoch in range(loader.epoch, 2):
        for index, x, y in loader:
            step = loader.loader.current_step
            steps.append((epoch, step, index.tolist()))
            loss = F.cross_entropy(model(x), y)
            dynamix.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            total = PLAN.get((epoch, step)) or (PLAN.get((epoch, -1)) if step == len(loader) - 1 else None)
            if total is not None:
                dynamix.set_batch_sizes(uneven(total, world))
            try:  # last in the iteration: a preemption saves the state here and nothing after it runs
                dynamix.step(loss)
            except Preempted as preempted:
                steps.append(("preempted", preempted.step, dynamix.seconds_to_save))
                torch.save({"steps": steps}, out / f"{config}-{run}-w{world}-rank{accelerator.process_index}.pt")
                raise
            if run == "preempt" and accelerator.process_index == 2 and dynamix.global_step == PREEMPT_AFTER:
                os.kill(os.getpid(), signal.SIGTERM)  # the spot notice, to one process only
            if run == "mid" and dynamix.global_step == MID_STEP:
                stop = True
                break
        if stop or (run == "end" and epoch == 0):
            accelerator.save_state(str(out / f"{config}-{run}-w{world}"))
            break
    dynamix.finish()
    params = {k: v.detach().cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    torch.save({"steps": steps, "params": params}, out / f"{config}-{run}-w{world}-rank{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()


world_size = int(os.environ["WORLD_SIZE"])
for config in CONFIGS:
    if resume_from is not None:
        for run in ("mid", "end"):
            train(config, f"resume-{run}-from{resume_from}", out / f"{config}-{run}-w{resume_from}")
    if resume_from is None or world_size < resume_from:
        for run in ("full", "mid", "end"):
            train(config, run)
if resume_from == 3:  # the state saved on a SIGTERM to one of 3 processes
    train("sgd-workers0", "resume-preempt-from3", out / "sgd-workers0-preempt-w3")
    # restarted after the end (by torch elastic, when a node joins as the job winds down): nothing to train
    train("sgd-workers0", "after-end", out / "sgd-workers0-preempt-w3")
if world_size == 3 and resume_from is None:  # last: it ends this launch with the preemption exit code
    train("sgd-workers0", "preempt")
Accelerator(cpu=not torch.cuda.is_available()).end_training()
