"""``dynamix bench policy``: the time PPOController takes to decide, at several world sizes."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from lightning_dynamix.bench.arguments import positive_ints


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default="default", help="policy file (default: the shipped one)")
    parser.add_argument("--world-sizes", type=positive_ints, default=[1, 8, 64], help="default 1,8,64")
    parser.add_argument("--decisions", type=int, default=500, help="timed decisions per world size (default 500)")
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")


def run(args: argparse.Namespace) -> None:
    """Time PPOController.decide (encoding, balancer, network, adjustment) on simulated states, one thread.

    Every timed decision gets a state it has not seen (a fresh copy), as in a real job, where nothing
    computed from one interval's measurements is reused. The network's forward pass alone is timed too.
    """
    from dataclasses import replace

    import torch

    from lightning_dynamix.control.ppo import PPOController
    from lightning_dynamix.rl.simulator import ClusterSimulator, ScenarioSpace

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        controller = PPOController(args.policy)
        results = {}
        print(f"PPOController.decide, {args.decisions} decisions per size, 1 thread")
        for n in args.world_sizes:
            scenario = ScenarioSpace().sample(np.random.default_rng(n), world_size=n)
            simulator = ClusterSimulator(scenario, 0)
            states = [simulator.reset()]
            for _ in range(19):
                states.append(simulator.run_interval(controller.decide(states[-1]).batch_sizes)[0])
            fresh = [replace(states[i % len(states)]) for i in range(args.decisions)]
            decide, forward = [], []
            for state in fresh:
                began = time.perf_counter()
                controller.decide(state)
                decide.append(time.perf_counter() - began)
            observations = [s.observation() for s in states]
            for i in range(args.decisions):
                began = time.perf_counter()
                controller.policy.network.act(observations[i % len(observations)])
                forward.append(time.perf_counter() - began)
            median, p99 = statistics.median(decide), float(np.percentile(decide, 99))
            network = statistics.median(forward)
            results[str(n)] = {"median_ms": median * 1e3, "p99_ms": p99 * 1e3, "network_median_ms": network * 1e3}
            print(
                f"  {n:>3} ranks: decision median {median * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms;"
                f" of it the network's forward pass {network * 1e3:.3f} ms"
            )
    finally:
        torch.set_num_threads(threads)  # as it was, for a caller in the same process
    if args.output is not None:
        args.output.write_text(json.dumps(results, indent=1))
