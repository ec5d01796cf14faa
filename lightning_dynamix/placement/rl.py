"""The RL scheduler of HeterPS: a policy that emits one resource type per layer, trained with PPO.

An episode places one chain, layer after layer. The observation describes the current layer (its
kind, size and position), each resource type as seen by that layer: the units it would need for the
target alone and within the stage it would join, its price, memory fit and units, the units and fit
of the whole rest of the chain on it, the cost of the whole placement if this layer and all after it
went to it (over the reward's scale, below), and the type chosen for the layer before. The action
is a type. When the last layer is placed the cost model prices the placement. The reward is minus
its cost per hour, divided by the cheapest single-type placement of the same problem, so problems
of any scale weigh alike; a placement that breaks a constraint gets ``-INFEASIBLE_PENALTY``.

The policy is trained with stable-baselines3's PPO on random problems
(:mod:`~lightning_dynamix.placement.random_chains`) or on given ones, after learning the exact
solver's placements of some of them (``imitation``: behaviour cloning, a cross-entropy over every
decision), and can continue from a saved scheduler (``init``), for instance to specialise a general
scheduler to one model. :func:`solve_rl`
decodes a placement with it, the policy's most likely types and ``samples`` sampled placements,
and keeps the cheapest feasible one.

Scheduler files hold only tensors and JSON (safetensors), like the batch-size policy files, so
loading one never runs code.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lightning_dynamix._checks import require_int
from lightning_dynamix.placement.cost import CostModel, PlacementPlan
from lightning_dynamix.placement.random_chains import random_problem, random_recommendation_problem
from lightning_dynamix.placement.solvers import _relaxed_dp, cheapest_feasible

MAX_TYPES = 4
INFEASIBLE_PENALTY = 3.0
MAX_TEMPERATURE = 4.0  # of the last sampled placement in solve_rl
TYPE_FEATURES = 12
LAYER_FEATURES = 5
OBSERVATION_SIZE = LAYER_FEATURES + MAX_TYPES * TYPE_FEATURES + MAX_TYPES + 1
_FORMAT = "lightning-dynamix-placement-scheduler"
_METADATA_KEY = "lightning_dynamix"

ProblemSource = Callable[[random.Random], CostModel]


def _log(value: float) -> float:
    return math.log10(max(value, 1e-12))


class PlacementEnv(gym.Env):
    """Places one problem's layers, one per step.

    Args:
        problems: a fixed list of cost models (drawn in turn), or a function of a ``random.Random``
            that makes a new one per episode.
        seed: seed of the problem draws.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, problems: Sequence[CostModel] | ProblemSource, seed: int = 0) -> None:
        super().__init__()
        self.problems = problems
        self.rng = random.Random(seed)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (OBSERVATION_SIZE,), np.float32)
        self.action_space = gym.spaces.Discrete(MAX_TYPES)
        self._draws = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        if seed is not None:
            self.rng = random.Random(seed)
        if callable(self.problems):
            self.model = self.problems(self.rng)
        else:
            self.model = self.problems[self._draws % len(self.problems)]
            self._draws += 1
        _check_types(self.model)
        self.reference = reference_cost(self.model)
        self.assignment: list[int] = []
        return observation(self.model, self.assignment, self.reference), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.assignment.append(int(action) % len(self.model.resources))
        if len(self.assignment) < self.model.num_layers:
            return observation(self.model, self.assignment, self.reference), 0.0, False, False, {}
        plan = self.model.plan(self.assignment)
        reward = -INFEASIBLE_PENALTY if plan is None else -plan.cost_per_hour / self.reference
        return np.zeros(OBSERVATION_SIZE, np.float32), float(reward), True, False, {"plan": plan}


def _check_types(model: CostModel) -> None:
    if len(model.resources) > MAX_TYPES:
        raise ValueError(f"the RL scheduler places on at most {MAX_TYPES} resource types, got {len(model.resources)}")


def reference_cost(model: CostModel) -> float:
    """The cheapest feasible single-type placement's cost per hour (the reward's scale); 1 if none is."""
    costs = [model.plan([k] * model.num_layers) for k in range(len(model.resources))]
    feasible = [plan.cost_per_hour for plan in costs if plan is not None]
    return min(feasible) if feasible and min(feasible) > 0 else 1.0


def observation(model: CostModel, assignment: Sequence[int], reference: float | None = None) -> np.ndarray:
    """What the policy sees before placing layer ``len(assignment)`` of ``model`` (``reference``: its
    :func:`reference_cost`, computed when not given)."""
    index = len(assignment)
    reference = reference_cost(model) if reference is None else reference
    layer = model.profile.layers[index]
    n = model.num_layers
    out = np.zeros(OBSERVATION_SIZE, np.float32)
    out[:LAYER_FEATURES] = [
        1.0 if layer.kind == "sparse" else 0.0,
        _log(layer.parameter_bytes) - 9,
        _log(layer.activation_bytes) - 4,
        index / n,
        (n - index) / n,
    ]
    previous = assignment[-1] if assignment else -1
    # the seconds of the stage the layer would join if it stays on the previous layer's type
    stage_start = index
    while stage_start > 0 and assignment[stage_start - 1] == previous:
        stage_start -= 1
    cheapest = min(r.price_per_hour for r in model.resources) or 1.0
    for k, resource in enumerate(model.resources):
        seconds = model.stage_seconds(index, index, k)
        joined = model.stage_seconds(stage_start, index, k) if k == previous and index > 0 else seconds
        fits = model.stage(index, index, k) is not None
        # the whole placement if this layer and all after it went to k: its cost, over the reference
        completed = model.plan([*assignment, *[k] * (n - index)])
        base = LAYER_FEATURES + k * TYPE_FEATURES
        out[base : base + TYPE_FEATURES] = [
            1.0,
            _log(model.target * seconds),  # units this layer alone needs
            _log(model.target * joined),  # units of the stage if the layer joins it
            _log(resource.price_per_hour / cheapest),
            _log(resource.price_per_hour * model.target * seconds / 3600),  # its cost per second, alone
            1.0 if fits else 0.0,
            1.0 if resource.device == "gpu" else 0.0,
            _log(resource.units),
            _log(model.target * model.stage_seconds(index, n - 1, k)),  # units if the rest all went here
            1.0 if model.stage(index, n - 1, k) is not None else 0.0,  # and whether that would fit
            0.0 if completed is None else _log(completed.cost_per_hour / reference),
            1.0 if completed is not None else 0.0,
        ]
    out[LAYER_FEATURES + MAX_TYPES * TYPE_FEATURES + (previous + 1 if previous >= 0 else 0)] = 1.0
    return out


@dataclass
class RLScheduler:
    """A trained placement policy (a stable-baselines3 actor-critic policy) and how it was trained."""

    policy: Any
    training: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        """Write the policy's tensors and metadata as safetensors."""
        path = Path(path)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.policy.state_dict().items()}
        meta = {"format": _FORMAT, "max_types": MAX_TYPES, "observation_size": OBSERVATION_SIZE}
        save_file(tensors, str(path), metadata={_METADATA_KEY: json.dumps({**meta, "training": self.training})})
        return path


def _new_ppo(env: gym.Env, seed: int, **kwargs: Any) -> Any:
    from stable_baselines3 import PPO

    from lightning_dynamix.rl.sb3 import silent_logger

    ppo = PPO("MlpPolicy", env, seed=seed, verbose=0, device="cpu", **kwargs)
    ppo.set_logger(silent_logger())
    return ppo


def default_scheduler_path() -> Path:
    """The scheduler that ships with the package: ``train_rl_scheduler(imitation=30000, timesteps=0, n_envs=8,
    seed=0, imitation_epochs=30)`` (the exact placements of 30,000 problems of :func:`training_problem`)."""
    return Path(str(resources.files("lightning_dynamix.placement") / "schedulers" / "default.safetensors"))


def load_rl_scheduler(path: str | Path | None = None) -> RLScheduler:
    """A scheduler written by :meth:`RLScheduler.save`; None: the shipped one.

    Raises:
        ValueError: for a file that is not a scheduler of this format.
    """
    path = default_scheduler_path() if path is None else Path(path)
    if not path.is_file():
        raise ValueError(f"no scheduler file at {path}")
    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads((handle.metadata() or {}).get(_METADATA_KEY, "{}"))
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (a safetensors handle is not a dict)
    if meta.get("format") != _FORMAT or meta.get("observation_size") != OBSERVATION_SIZE:
        raise ValueError(f"{path} is not a placement scheduler of this version ({meta.get('format')!r})")
    ppo = _new_ppo(PlacementEnv(lambda rng: random_problem(rng.randrange(2**31), 2, 2)), seed=0)
    ppo.policy.load_state_dict(tensors)
    return RLScheduler(ppo.policy, meta.get("training", {}))


def train_rl_scheduler(
    problems: Sequence[CostModel] | ProblemSource | None = None,
    timesteps: int = 50_000,
    init: RLScheduler | str | Path | None = None,
    n_envs: int = 4,
    seed: int = 0,
    imitation: int = 0,
    imitation_epochs: int = 25,
    learning_rate: float = 1e-3,
    ent_coef: float = 0.01,
) -> RLScheduler:
    """Train (or continue training ``init``) with PPO on ``problems``; default: :func:`training_problem`.

    With ``imitation``, the policy first learns the exact solver's placements of that many problems
    drawn from ``problems`` (behaviour cloning: ``imitation_epochs`` passes of cross-entropy over
    every decision), then PPO trains it ``timesteps`` steps (0: none). Problems whose optimum needs
    the scarce-units programme (see :func:`~lightning_dynamix.placement.solve_dp`), or have no
    feasible placement, are left out of the imitation.
    """
    from stable_baselines3.common.vec_env import DummyVecEnv

    require_int("timesteps", timesteps, 0)
    require_int("imitation", imitation, 0)
    require_int("imitation_epochs", imitation_epochs, 1)
    source = problems if problems is not None else training_problem
    env = DummyVecEnv([lambda i=i: PlacementEnv(source, seed=seed * 1000 + i) for i in range(n_envs)])
    ppo = _new_ppo(env, seed, n_steps=256, batch_size=256, gamma=1.0, ent_coef=ent_coef, learning_rate=learning_rate)
    training: dict[str, Any] = {}
    if init is not None:
        start = init if isinstance(init, RLScheduler) else load_rl_scheduler(init)
        ppo.policy.load_state_dict(start.policy.state_dict())
        training["init"] = start.training
    if imitation:
        training["imitation"] = imitate(ppo.policy, source, imitation, imitation_epochs, seed)
    if timesteps:
        ppo.learn(total_timesteps=timesteps)
    training.update(
        {
            "timesteps": timesteps,
            "n_envs": n_envs,
            "seed": seed,
            "problems": _describe(problems),
            "learning_rate": learning_rate,
            "ent_coef": ent_coef,
        }
    )
    return RLScheduler(ppo.policy, training)


def imitate(
    policy: Any, problems: Sequence[CostModel] | ProblemSource, count: int, epochs: int = 25, seed: int = 0
) -> dict[str, Any]:
    """Teach ``policy`` (a stable-baselines3 actor-critic policy) the exact solver's placements of
    ``count`` problems (drawn from ``problems``, or taken in turn from a list) by cross-entropy on
    every decision; returns what it learned from and its ``accuracy``: the share of those decisions its
    most likely type got right in the last epoch, each batch before its own update."""
    rng = random.Random(seed)
    observations, actions, solved = [], [], 0
    for draw in range(count):
        model = problems(rng) if callable(problems) else problems[draw % len(problems)]
        _check_types(model)
        plan = _relaxed_dp(model)  # exact wherever it returns a plan
        if plan is None:
            continue
        solved += 1
        index = {resource.name: k for k, resource in enumerate(model.resources)}
        assignment = [index[name] for name in plan.assignment]
        reference = reference_cost(model)
        for layer in range(model.num_layers):
            observations.append(observation(model, assignment[:layer], reference))
            actions.append(assignment[layer])
    if not observations:
        raise ValueError(f"none of the {count} problems drawn has a placement the exact solver could imitate")
    inputs, targets = torch.as_tensor(np.stack(observations)), torch.as_tensor(actions)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(seed)
    correct = 0
    for _ in range(epochs):
        correct = 0
        for batch in torch.randperm(len(inputs), generator=generator).split(512):
            logits = policy.get_distribution(inputs[batch]).distribution.logits
            loss = torch.nn.functional.cross_entropy(logits, targets[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            correct += int((logits.detach().argmax(1) == targets[batch]).sum())
    accuracy = correct / len(inputs)
    return {"problems": count, "solved": solved, "decisions": len(inputs), "epochs": epochs, "accuracy": accuracy}


def training_problem(rng: random.Random) -> CostModel:
    """The problems the shipped scheduler trains on: half random chains of 2-64 layers on 2-4 types
    (:func:`~lightning_dynamix.placement.random_chains.random_problem`), a fifth recommendation models,
    and three tenths recommendation models with the offload runner's terms
    (:func:`~lightning_dynamix.placement.random_chains.random_recommendation_problem`)."""
    draw = rng.random()
    if draw < 0.5:
        return random_problem(rng.randrange(2**31), (2, 64), (2, MAX_TYPES))
    return random_recommendation_problem(rng.randrange(2**31), runner=draw >= 0.7)


def _describe(problems: object) -> str:
    if problems is None:
        return "random chains of 2-64 layers on 2-4 types, recommendation models with and without the runner's terms"
    if callable(problems):
        return getattr(problems, "__name__", "a problem generator")
    return f"{len(problems)} given problems"  # type: ignore[arg-type]


def solve_rl(model: CostModel, scheduler: RLScheduler, samples: int = 32, seed: int = 0) -> PlacementPlan:
    """The cheapest feasible placement among the policy's most likely one and ``samples`` sampled ones."""
    _check_types(model)
    generator = torch.Generator().manual_seed(seed)
    return cheapest_feasible(
        model, (_decode(model, scheduler, a, samples, generator) for a in range(samples + 1)), "rl"
    )


def _decode(
    model: CostModel, scheduler: RLScheduler, attempt: int, samples: int, generator: torch.Generator
) -> list[int]:
    """Attempt 0: the policy's most likely types; then samples at a rising temperature."""
    assignment: list[int] = []
    reference = reference_cost(model)
    for _ in range(model.num_layers):
        obs = torch.as_tensor(observation(model, assignment, reference)).unsqueeze(0)
        with torch.no_grad():
            logits = scheduler.policy.get_distribution(obs).distribution.logits[0, : len(model.resources)]
        if attempt == 0:
            action = int(torch.argmax(logits))
        else:
            # hotter and hotter: the later samples explore further from the policy's own choice
            temperature = 1.0 + (MAX_TEMPERATURE - 1.0) * attempt / samples
            action = int(torch.multinomial(torch.softmax(logits / temperature, 0), 1, generator=generator))
        assignment.append(action)
    return assignment
