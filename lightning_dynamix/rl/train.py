"""Train a batch-size policy with stable-baselines3's PPO in the cluster simulator, and write its policy file.

:func:`train_policy` runs PPO (vectorised :class:`~lightning_dynamix.rl.env.DynamixEnv` copies,
the rank-shared :class:`~lightning_dynamix.control.ppo.sb3.SharedRankPolicy`), logs to CSV and TensorBoard,
evaluates the result against the static, pid and goodput controllers on held-out scenarios, and
writes a policy file (:mod:`~lightning_dynamix.control.ppo.files`) whose metadata records all of it.
``dynamix train-policy`` is the command-line front.

Held-out scenarios are drawn with seeds no training environment uses (training draws from seed
``seed``, evaluation from ``EVALUATION_SEED + seed``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_dynamix._checks import require_bool, require_int, require_number
from lightning_dynamix.control.ppo.files import PolicyFile, load_policy, save_policy
from lightning_dynamix.control.ppo.reward import RewardWeights
from lightning_dynamix.rl.env import DynamixEnv
from lightning_dynamix.rl.evaluate import compare, controller_factory, summarize
from lightning_dynamix.rl.simulator import Scenario, ScenarioSpace

EVALUATION_SEED = 1_000_000


@dataclass(frozen=True)
class TrainingConfig:
    """How a policy is trained.

    Attributes:
        timesteps: environment steps (decision intervals) PPO trains on.
        n_envs: simulated jobs stepped together.
        seed: seeds PPO, the environments and the evaluation scenarios.
        max_world_size: the most ranks the policy serves.
        episode_intervals: the most decisions per episode (it ends earlier at the target accuracy).
        hidden: width of the network's hidden layers.
        layers: hidden layers of actor and critic.
        n_steps: steps per environment between two PPO updates.
        batch_size: PPO minibatch size.
        n_epochs: passes over each rollout.
        learning_rate: Adam's learning rate.
        gamma: discount per decision.
        gae_lambda: GAE's lambda.
        ent_coef: entropy bonus.
        clip_range: PPO's clip range.
        evaluation_scenarios: held-out scenarios per evaluated world size.
        evaluation_world_sizes: world sizes of the held-out scenarios.
        scenario_space: what training scenarios are drawn from.
        reward_weights: the reward's penalties.
        subprocesses: step the ``n_envs`` simulated jobs in their own processes (stable-baselines3's
            ``SubprocVecEnv``: faster with as many free cores; the same transitions as in one process).
        device: where PPO's network trains (``"cpu"`` or ``"cuda"``); the policy file is the same.
    """

    timesteps: int = 1_300_000
    n_envs: int = 8
    seed: int = 0
    max_world_size: int = 64
    episode_intervals: int = 512
    hidden: int = 64
    layers: int = 2
    n_steps: int = 256
    batch_size: int = 512
    n_epochs: int = 4
    learning_rate: float = 3e-4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    ent_coef: float = 0.003
    clip_range: float = 0.2
    evaluation_scenarios: int = 4
    evaluation_world_sizes: tuple[int, ...] = (4, 8, 16, 32, 64)
    scenario_space: ScenarioSpace = field(default_factory=ScenarioSpace)
    reward_weights: RewardWeights = field(default_factory=RewardWeights)
    subprocesses: bool = False
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name, low in (
            ("timesteps", 1),
            ("n_envs", 1),
            ("seed", 0),
            ("max_world_size", 1),
            ("episode_intervals", 1),
            ("hidden", 1),
            ("layers", 1),
            ("n_steps", 2),
            ("batch_size", 2),
            ("n_epochs", 1),
            ("evaluation_scenarios", 0),
        ):
            require_int(name, getattr(self, name), low)
        require_number("learning_rate", self.learning_rate, 0.0, low_open=True)
        require_number("gamma", self.gamma, 0.0, 1.0, high_open=False)
        require_number("gae_lambda", self.gae_lambda, 0.0, 1.0, high_open=False)
        require_number("ent_coef", self.ent_coef, 0.0)
        require_number("clip_range", self.clip_range, 0.0, low_open=True)
        require_bool("subprocesses", self.subprocesses)
        if self.device not in ("cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"`device` must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if max(self.scenario_space.world_sizes) > self.max_world_size:
            raise ValueError(
                f"`scenario_space.world_sizes` reach {max(self.scenario_space.world_sizes)} ranks, above"
                f" `max_world_size`={self.max_world_size}"
            )
        if any(n > self.max_world_size for n in self.evaluation_world_sizes):
            raise ValueError(
                f"`evaluation_world_sizes` {list(self.evaluation_world_sizes)} exceed"
                f" `max_world_size`={self.max_world_size}"
            )

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self)))


PRESETS: dict[str, TrainingConfig] = {
    # the policy that ships with the package (lightning_dynamix/control/ppo/policies/default.safetensors)
    "default": TrainingConfig(),
    # a few minutes on a laptop: to try the pipeline
    "small": TrainingConfig(timesteps=30_000, evaluation_scenarios=2, evaluation_world_sizes=(4, 16)),
    # seconds: for tests
    "tiny": TrainingConfig(
        timesteps=1_024, n_envs=2, n_steps=64, batch_size=64, evaluation_scenarios=1, evaluation_world_sizes=(4,)
    ),
}


def preset(name: str, **overrides: Any) -> TrainingConfig:
    """The training configuration named ``name`` in :data:`PRESETS`, with ``overrides`` applied."""
    if name not in PRESETS:
        raise ValueError(f"`preset` must be one of {sorted(PRESETS)}, got {name!r}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


def held_out_scenarios(config: TrainingConfig) -> list[Scenario]:
    """``evaluation_scenarios`` scenarios per evaluated world size, from seeds training never draws."""
    rng = np.random.default_rng(EVALUATION_SEED + config.seed)
    return [
        config.scenario_space.sample(rng, world_size=n)
        for n in config.evaluation_world_sizes
        for _ in range(config.evaluation_scenarios)
    ]


def train_policy(
    config: TrainingConfig,
    output: str | Path,
    log_dir: str | Path | None = None,
    progress_bar: bool = False,
    evaluate: bool = True,
    preset_name: str | None = None,
    init: str | Path | PolicyFile | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Train a policy with PPO, evaluate it, write the policy file.

    Args:
        config: the training configuration.
        output: the policy file to write (``.safetensors``).
        log_dir: where PPO's CSV and TensorBoard logs go; ``None`` for none.
        progress_bar: show a progress bar on standard error.
        evaluate: compare the trained policy with static, pid and goodput on held-out scenarios.
        preset_name: recorded in the file's metadata.
        init: a policy file (or one loaded) to start from (``"default"``: the shipped one) instead of an untrained
            network: training continues from its weights (actor and critic), and its own training
            record is kept in the new file's under ``"init"``. It must have the configuration's
            ``max_world_size``, ``hidden`` and ``layers``.

    Returns:
        The written path and the training record stored in its metadata.
    """
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.logger import configure
    from stable_baselines3.common.vec_env import SubprocVecEnv

    from lightning_dynamix.control.ppo.sb3 import SharedRankPolicy, silent_logger

    start = initial_policy(init, config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads cost more than they give
    try:
        env = make_vec_env(
            lambda: DynamixEnv(
                config.scenario_space,
                max_world_size=config.max_world_size,
                episode_intervals=config.episode_intervals,
                reward_weights=config.reward_weights,
            ),
            n_envs=config.n_envs,
            seed=config.seed,
            vec_env_cls=SubprocVecEnv if config.subprocesses else None,
            vec_env_kwargs={"start_method": "fork"} if config.subprocesses else None,
        )
        model = PPO(
            SharedRankPolicy,
            env,
            n_steps=config.n_steps,
            batch_size=config.batch_size,
            n_epochs=config.n_epochs,
            learning_rate=config.learning_rate,
            gamma=config.gamma,
            gae_lambda=config.gae_lambda,
            ent_coef=config.ent_coef,
            clip_range=config.clip_range,
            policy_kwargs={"hidden": config.hidden, "layers": config.layers},
            seed=config.seed,
            device=config.device,
            verbose=0,
        )
        if start is not None:
            model.policy.network.load_state_dict(start.network.state_dict())
        model.set_logger(silent_logger() if log_dir is None else configure(str(log_dir), ["csv", "tensorboard"]))
        started = time.perf_counter()
        callbacks = [_ProgressBar(config.timesteps)] if progress_bar else []
        model.learn(total_timesteps=config.timesteps, callback=callbacks)
        seconds = time.perf_counter() - started
        env.close()
    finally:
        torch.set_num_threads(threads)
    network = model.policy.network.cpu()
    network.eval()
    record: dict[str, Any] = {
        "preset": preset_name,
        "config": config.to_dict(),
        "timesteps": int(model.num_timesteps),
        "training_seconds": round(seconds, 1),
        "mean_episode_reward": _mean_episode_reward(model),
    }
    if start is not None:
        record["init"] = {"path": None if start.path is None else str(start.path), "training": start.training}
    policy = PolicyFile(network=network, max_world_size=config.max_world_size, training=record)
    if evaluate and config.evaluation_scenarios > 0:
        record["evaluation"] = evaluate_policy(policy, held_out_scenarios(config), seed=config.seed)
    return save_policy(policy, output), record


def initial_policy(init: str | Path | PolicyFile | None, config: TrainingConfig) -> PolicyFile | None:
    """The policy training starts from, loaded and checked against ``config``; ``None`` for a fresh network."""
    if init is None:
        return None
    start = init if isinstance(init, PolicyFile) else load_policy(init)
    mine = (config.max_world_size, config.hidden, config.layers)
    theirs = (start.max_world_size, start.network.hidden, start.network.layers)
    if mine != theirs:
        raise ValueError(
            f"`init` {str(start.path)!r} has max_world_size, hidden, layers = {theirs}, the configuration {mine};"
            " train with the same values or start from a fresh network"
        )
    return start


def evaluate_policy(
    policy: PolicyFile,
    scenarios: Sequence[Scenario],
    seed: int = 0,
    baselines: Sequence[str] = ("static", "pid", "goodput"),
) -> dict[str, Any]:
    """The policy against ``baselines`` on ``scenarios``: summaries by world size and over all of them."""
    from lightning_dynamix.control.ppo import PPOController

    factories = {name: controller_factory(name) for name in baselines}
    factories["ppo"] = lambda scenario: PPOController(policy)
    results = compare(scenarios, factories, seed=EVALUATION_SEED + seed)
    by_size: dict[str, Any] = {}
    for n in sorted({s.world_size for s in scenarios}):
        subset = [r for s, r in zip(scenarios, results) if s.world_size == n]
        by_size[str(n)] = _rounded(summarize(subset))
    return {"scenarios": len(scenarios), "by_world_size": by_size, "all": _rounded(summarize(results))}


def _rounded(summary: dict[str, dict[str, float]]) -> dict[str, dict[str, float | None]]:
    return {
        name: {k: (round(v, 4) if math.isfinite(v) else None) for k, v in values.items()}
        for name, values in summary.items()
    }


def _mean_episode_reward(model: Any) -> float | None:
    episodes = [e["r"] for e in model.ep_info_buffer] if model.ep_info_buffer else []
    return round(float(np.mean(episodes)), 4) if episodes else None


def _progress_bar_class() -> type:
    from stable_baselines3.common.callbacks import BaseCallback
    from tqdm import tqdm

    class ProgressBar(BaseCallback):
        def __init__(self, total: int) -> None:
            super().__init__()
            self.total = total

        def _on_training_start(self) -> None:
            self.bar = tqdm(total=self.total, unit="step", desc="training policy")

        def _on_step(self) -> bool:
            self.bar.update(self.training_env.num_envs)
            return True

        def _on_training_end(self) -> None:
            self.bar.close()

    return ProgressBar


def _ProgressBar(total: int) -> Any:
    return _progress_bar_class()(total)
