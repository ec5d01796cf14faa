"""DynamixAccelerate with pid under `accelerate launch`: rank 1 3x slower (a virtual clock); metrics to TensorBoard.

Usage: accelerate launch --multi_gpu --num_processes 2 accelerate_pid_job.py OUT_DIR MODE
MODE: balance (60 steps), first (30 steps, save_state after step 20), resume (load_state, run to step 30).
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynamix.integrations.accelerate import DynamixAccelerate
from lightning_dynamix.metrics.clocks import HostClock

out, mode = Path(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
accelerator = Accelerator(cpu=not torch.cuda.is_available(), log_with="tensorboard", project_dir=str(out))
accelerator.init_trackers("pid")
# rank 1 computes 3x slower on a virtual clock that only the ranks' own samples move: pid's decisions are the
# same on every run, whatever this machine's load
now = [0.0]
dynamix = DynamixAccelerate(
    accelerator, batch_sizes=[64, 64], controller="pid", interval=5, warmup_steps=5, seed=3,
    time_source=HostClock(lambda: now[0]),
)  # fmt: skip
generator = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(8192, 64, generator=generator), torch.randint(4, (8192,), generator=generator))
torch.manual_seed(0)
network = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4))
optimizer = torch.optim.SGD(network.parameters(), lr=0.05)
model, optimizer, loader = dynamix.prepare(network, optimizer, DataLoader(data, batch_size=64, shuffle=True))
if mode == "resume":
    accelerator.load_state(str(out / "checkpoint"))
start = {"step": dynamix.global_step, "sizes": list(dynamix.batch_sizes), "maker": dynamix.maker.state_dict()}

last = {"balance": 60, "first": 30, "resume": 30}[mode]
trained = []
while dynamix.global_step < last:
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        now[0] += len(y) * 1e-4 * (3.0 if accelerator.process_index == 1 else 1.0)
        dynamix.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        dynamix.step(loss)
        trained.append({"step": dynamix.global_step, "size": len(y), "first": x[0, 0].item()})
        if mode == "first" and dynamix.global_step == 20:
            accelerator.save_state(str(out / "checkpoint"))
            saved = {"step": 20, "sizes": list(dynamix.batch_sizes), "maker": dynamix.maker.state_dict()}
        if dynamix.global_step >= last:
            break

accelerator.end_training()
result = {
    "start": start,
    "trained": trained,
    "history": [
        {"step": r.step, "sizes": list(r.state.batch_sizes), "decision": list(r.decision.batch_sizes),
         "compute": [w.compute_time for w in r.state.workers]}
        for r in dynamix.history
    ],
}  # fmt: skip
if mode == "first":
    result["saved"] = saved
(out / f"{mode}-rank{accelerator.process_index}.json").write_text(json.dumps(result))
