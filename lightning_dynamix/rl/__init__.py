"""Learned batch-size control (DYNAMIX), trained in simulation: cluster simulator, gymnasium environment, PPO
training, evaluation against the controllers, calibration of a scenario to a run's logs.

What a real job runs (the policy network, policy files, online fine-tuning) is
:mod:`lightning_dynamix.control.ppo`'s: this package imports it, never the other way round.
Importing this package does not import stable-baselines3; only training a policy does.
"""

from lightning_dynamix.rl.simulator import ClusterSimulator, IntervalOutcome, Scenario, ScenarioSpace, with_world_size

__all__ = ["ClusterSimulator", "IntervalOutcome", "Scenario", "ScenarioSpace", "with_world_size"]
