"""The RL scheduler of HeterPS: a policy that emits one resource type per layer, trained with PPO.

An episode places one chain, layer after layer. The observation describes the current layer (its
kind, size and position), each resource type as seen by that layer: the units it would need for the
target alone and within the stage it would join, its price, memory fit and units, the units and fit
of the whole rest of the chain on it, the cost of the whole placement if this layer and all after it
went to it (over the reward's scale, below), the cost of the cheapest placement where this layer's
stage on it ends anywhere and one stage of another type takes the rest (each stage priced alone),
and the type chosen for the layer before. The action
is a type. When the last layer is placed the cost model prices the placement. The reward is minus
its cost per hour, divided by the cheapest single-type placement of the same problem (by the
optimum's where no single type is feasible), so problems of any scale weigh alike; a placement that
breaks a constraint gets ``-INFEASIBLE_PENALTY``.

The policy is trained with stable-baselines3's PPO on random problems
(:mod:`~lightning_dynamix.placement.random_chains`) or on given ones, after learning the exact
solver's placements of some of them (``imitation``: behaviour cloning, a cross-entropy over every
decision), and can continue from a saved scheduler (``init``), for instance to specialise a general
scheduler to one model. :func:`solve_rl` decodes a placement with it: the policy's most likely
types, ``samples`` sampled placements, and the placements of an active search (a copy of the policy
trained by policy gradients on that one problem); it keeps the cheapest feasible one.

Scheduler files hold only tensors and JSON (safetensors), like the batch-size policy files, so
loading one never runs code.
"""

from __future__ import annotations

import copy
import json
import math
import random
import weakref
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

from lightning_dynamix._checks import require_int, require_number
from lightning_dynamix.placement.cost import CostModel, PlacementPlan, Stage
from lightning_dynamix.placement.random_chains import random_problem, random_recommendation_problem
from lightning_dynamix.placement.solvers import _relaxed_dp, best_actions, cheapest_feasible, completions

MAX_TYPES = 4
INFEASIBLE_PENALTY = 3.0
MAX_TEMPERATURE = 4.0  # of the last sampled placement in solve_rl
SEARCH_ROUNDS = 10  # of active search in solve_rl, by default
TYPE_FEATURES = 14
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
        # reference_cost falls back to 1 where no single type is feasible: only then is the scale another
        self.scale = reward_scale(self.model) if self.reference == 1.0 else self.reference
        self.assignment: list[int] = []
        return observation(self.model, self.assignment, self.reference), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.assignment.append(int(action) % len(self.model.resources))
        if len(self.assignment) < self.model.num_layers:
            return observation(self.model, self.assignment, self.reference), 0.0, False, False, {}
        plan = self.model.plan(self.assignment)
        reward = -INFEASIBLE_PENALTY if plan is None else -plan.cost_per_hour / self.scale
        return np.zeros(OBSERVATION_SIZE, np.float32), float(reward), True, False, {"plan": plan}


def _check_types(model: CostModel) -> None:
    if len(model.resources) > MAX_TYPES:
        raise ValueError(f"the RL scheduler places on at most {MAX_TYPES} resource types, got {len(model.resources)}")


def reference_cost(model: CostModel) -> float:
    """The cheapest feasible single-type placement's cost per hour (the observation's scale); 1 if none is."""
    feasible = _single_type_costs(model)
    return min(feasible) if feasible and min(feasible) > 0 else 1.0


def _single_type_costs(model: CostModel) -> list[float]:
    costs = [model.plan([k] * model.num_layers) for k in range(len(model.resources))]
    return [plan.cost_per_hour for plan in costs if plan is not None]


def reward_scale(model: CostModel) -> float:
    """What an episode's cost per hour is divided by: the :func:`reference_cost` where a single-type
    placement is feasible; where none is, the optimum's cost (the relaxed programme's, when it finds
    one), so that a feasible placement's reward stays on the same scale, above a broken one's for
    placements up to ``INFEASIBLE_PENALTY`` times the optimum; 1 where neither is found."""
    if _single_type_costs(model):
        return reference_cost(model)
    plan = _relaxed_dp(model)
    return plan.cost_per_hour if plan is not None and plan.cost_per_hour > 0 else 1.0


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
    closed = _closed(model, assignment, stage_start)
    open_stage = model.stage(stage_start, index - 1, previous) if index > 0 and closed is not None else None
    open_cost = 0.0 if index == 0 else math.inf if open_stage is None else open_stage.cost_per_hour
    for k, resource in enumerate(model.resources):
        seconds = model.stage_seconds(index, index, k)
        joined = model.stage_seconds(stage_start, index, k) if k == previous and index > 0 else seconds
        fits = model.stage(index, index, k) is not None
        # the whole placement if this layer and all after it went to k: its cost, over the reference
        completed = _completed(model, closed, open_stage, stage_start, index, previous, k)
        # the cheapest placement where k's stage ends somewhere and one stage of another type takes the rest
        switched = math.inf if closed is None else closed[0]
        switched += _switch_once(model, stage_start, index, previous, k, open_cost)
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
            0.0 if completed is None else _log(completed / reference),
            1.0 if completed is not None else 0.0,
            0.0 if switched == math.inf else _log(switched / reference),
            1.0 if switched < math.inf else 0.0,
        ]
    out[LAYER_FEATURES + MAX_TYPES * TYPE_FEATURES + (previous + 1 if previous >= 0 else 0)] = 1.0
    return out


# per problem: the cheapest one-switch rests of _switch_once, and the single stages after them
_SWITCHES: weakref.WeakKeyDictionary[CostModel, dict[tuple[str, int, int], Any]] = weakref.WeakKeyDictionary()


def _switch_once(model: CostModel, start: int, index: int, previous: int, k: int, open_cost: float) -> float:
    """The cheapest cost per hour of the layers from ``start`` on (the stages before it left out) where
    layer ``index`` goes to ``k`` and at most one stage of another type follows k's, to the end (each
    stage priced alone, as the relaxed programme does; ``open_cost``: the open stage ``start..index-1``
    on ``previous``, for when it ends here). Computed once per problem for every stage start and type:
    O(layers^2 x types) in all."""
    if k == previous and index > 0:  # the open stage goes on
        return _one_switch(model, start, k)[index - start]
    return open_cost + _one_switch(model, index, k)[0]


def _one_switch(model: CostModel, first: int, k: int) -> list[float]:
    """Per ``index >= first``: the cheapest stage ``first..last`` on ``k`` with ``last >= index``, plus
    the cheapest single stage after it on another type."""
    cache = _SWITCHES.setdefault(model, {})
    key = ("switch", first, k)
    if key not in cache:
        best, found = math.inf, []
        for last in reversed(range(first, model.num_layers)):
            stage = model.stage(first, last, k)
            if stage is not None:
                best = min(best, stage.cost_per_hour + _tail(model, cache, last + 1, k))
            found.append(best)
        cache[key] = found[::-1]
    return cache[key]


def _tail(model: CostModel, cache: dict[tuple[str, int, int], Any], first: int, k: int) -> float:
    """The cheapest single stage of layers ``first..`` on a type other than ``k`` (0 past the last layer)."""
    if first == model.num_layers:
        return 0.0
    key = ("tail", first, k)
    if key not in cache:
        stages = [model.stage(first, model.num_layers - 1, kk) for kk in range(len(model.resources)) if kk != k]
        cache[key] = min((stage.cost_per_hour for stage in stages if stage is not None), default=math.inf)
    return cache[key]


def _closed(model: CostModel, assignment: Sequence[int], end: int) -> tuple[float, list[int]] | None:
    """The cost per hour and units per type of the stages of ``assignment[:end]``; None if one is infeasible."""
    cost, units, first = 0.0, [0] * len(model.resources), 0
    for index in range(1, end + 1):
        if index == end or assignment[index] != assignment[first]:
            stage = model.stage(first, index - 1, assignment[first])
            if stage is None:
                return None
            cost += stage.cost_per_hour
            units[assignment[first]] += stage.units
            first = index
    return cost, units


def _completed(
    model: CostModel,
    closed: tuple[float, list[int]] | None,
    open_stage: Stage | None,
    start: int,
    index: int,
    previous: int,
    k: int,
) -> float | None:
    """The cost per hour of the placement whose stages before ``start`` are ``closed``, whose open stage
    ``start..index-1`` is on ``previous`` (``open_stage``, when it ends there), and whose layers from
    ``index`` on all go to ``k`` (what ``model.plan`` of it would say; None where it is infeasible)."""
    if closed is None:
        return None
    n = model.num_layers
    if k == previous or index == 0:
        stages = [(model.stage(start, n - 1, k), k)]
    else:
        stages = [(open_stage, previous), (model.stage(index, n - 1, k), k)]
    cost, units = closed[0], list(closed[1])
    for stage, resource in stages:
        if stage is None:
            return None
        cost += stage.cost_per_hour
        units[resource] += stage.units
    if any(used > resource.units for used, resource in zip(units, model.resources, strict=True)):
        return None
    return cost


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
    every decision, see :func:`imitate`), then PPO trains it ``timesteps`` steps (0: none). Problems whose optimum needs
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
    every decision. A decision's target is every type that the cheapest completion of the placement
    so far starts with (:func:`~lightning_dynamix.placement.solvers.best_actions`), shared equally:
    placements of equal cost are all right. Returns what it learned from and its ``accuracy``: the
    share of the decisions whose most likely type is one of their targets in the last epoch, each
    batch before its own update."""
    rng = random.Random(seed)
    observations: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    solved = 0
    for draw in range(count):
        model = problems(rng) if callable(problems) else problems[draw % len(problems)]
        _check_types(model)
        plan = _relaxed_dp(model)  # exact wherever it returns a plan
        if plan is None:
            continue
        solved += 1
        index = {resource.name: k for k, resource in enumerate(model.resources)}
        _label(model, [index[name] for name in plan.assignment], observations, targets)
    if not observations:
        raise ValueError(f"none of the {count} problems drawn has a placement the exact solver could imitate")
    accuracy = _fit(policy, observations, targets, epochs, torch.Generator().manual_seed(seed))
    return {"problems": count, "solved": solved, "decisions": len(observations), "epochs": epochs, "accuracy": accuracy}


def _label(model: CostModel, assignment: Sequence[int], observations: list, targets: list) -> None:
    """Every decision of the optimal ``assignment``, with all its best types."""
    go = completions(model)
    reference = reference_cost(model)
    for layer in range(model.num_layers):
        best = best_actions(model, assignment[:layer], go)
        target = np.zeros(MAX_TYPES, np.float32)
        target[best] = 1.0 / len(best)
        observations.append(observation(model, assignment[:layer], reference))
        targets.append(target)


def _fit(policy: Any, observations: list, targets: list, epochs: int, generator: torch.Generator) -> float:
    """``epochs`` passes of cross-entropy over the decisions; the last pass's accuracy."""
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    inputs, wanted = torch.as_tensor(np.stack(observations)), torch.as_tensor(np.stack(targets))
    correct = 0
    for _ in range(epochs):
        correct = 0
        for batch in torch.randperm(len(inputs), generator=generator).split(512):
            logits = policy.get_distribution(inputs[batch]).distribution.logits
            loss = torch.nn.functional.cross_entropy(logits, wanted[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            chosen = logits.detach().argmax(1)
            correct += int((wanted[batch].gather(1, chosen.unsqueeze(1)) > 0).sum())
    return correct / len(inputs)


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


def solve_rl(
    model: CostModel,
    scheduler: RLScheduler,
    samples: int = 32,
    seed: int = 0,
    search: int = SEARCH_ROUNDS,
    search_learning_rate: float = 1e-3,
) -> PlacementPlan:
    """The cheapest feasible placement among the policy's most likely one, ``samples`` sampled ones (at
    a rising temperature), and those of ``search`` rounds of active search.

    Active search (Bello, Pham, Le, Norouzi and Bengio, 2016) trains a copy of the policy on this one
    problem: each round draws ``samples`` placements from it and takes a policy-gradient step
    (REINFORCE, the round's mean reward as the baseline) toward the cheaper ones. It finds what the
    policy alone misses where a better placement needs several decisions changed together; ``search=0``
    leaves the policy as it is. ``scheduler`` is never changed.

    Raises:
        ValueError: for a bad argument, or a problem of more resource types than the policy places on.
    """
    _check_types(model)
    require_int("samples", samples, 0)
    require_int("search", search, 0)
    if search and samples < 2:
        raise ValueError(f"active search compares the placements of a round: `samples` must be >= 2, got {samples}")
    require_number("search_learning_rate", search_learning_rate, 0.0, low_open=True)
    generator = torch.Generator().manual_seed(seed)
    reference = reference_cost(model)
    # hotter and hotter: the later samples explore further from the policy's own choice
    temperatures = [0.0] + [1.0 + (MAX_TEMPERATURE - 1.0) * attempt / samples for attempt in range(1, samples + 1)]
    placements = _rollouts(model, scheduler.policy, temperatures, generator, reference)[0]
    if search:
        costs = [plan.cost_per_hour for plan in map(model.plan, placements) if plan is not None]
        scale = min(costs) if costs and min(costs) > 0 else reference  # what the search's rewards are over
        placements += _active_search(
            model, scheduler.policy, search, samples, search_learning_rate, generator, reference, scale
        )
    return cheapest_feasible(model, placements, "rl")


def _active_search(
    model: CostModel,
    policy: Any,
    rounds: int,
    batch: int,
    learning_rate: float,
    generator: torch.Generator,
    reference: float,
    scale: float,
) -> list[list[int]]:
    """The placements drawn in ``rounds`` rounds of REINFORCE on ``model`` alone, by a copy of ``policy``
    (``reference``: the observation's :func:`reference_cost`; ``scale``: the cost per hour the rewards
    are over)."""
    policy = copy.deepcopy(policy)
    optimizer = torch.optim.Adam(policy.parameters(), lr=learning_rate)
    types = len(model.resources)
    found: list[list[int]] = []
    for _ in range(rounds):
        placements, inputs, actions = _rollouts(model, policy, [1.0] * batch, generator, reference)
        found += placements
        rewards = torch.tensor([_search_reward(model, placement, scale) for placement in placements])
        advantage = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
        logits = policy.get_distribution(inputs.flatten(0, 1)).distribution.logits[:, :types]
        chosen = torch.log_softmax(logits, 1).gather(1, actions.reshape(-1, 1)).view(batch, -1).sum(1)
        loss = -(advantage * chosen).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return found


def _search_reward(model: CostModel, placement: Sequence[int], scale: float) -> float:
    """Minus the cost per hour over ``scale`` (the cheapest placement found before the search), at most
    ``INFEASIBLE_PENALTY``; a placement that breaks a constraint gets less, and is told apart from
    another by how far it is from the units there are, so that a search whose draws all break one still
    learns: ``-INFEASIBLE_PENALTY`` less, per type, the units its stages would need at the target
    beyond those there are, over those there are (at most 10), less a millionth."""
    plan = model.plan(placement)
    if plan is not None:
        return -min(plan.cost_per_hour / scale, INFEASIBLE_PENALTY)
    needed, first = [0.0] * len(model.resources), 0
    for index in range(1, model.num_layers + 1):
        if index == model.num_layers or placement[index] != placement[first]:
            needed[placement[first]] += model.target * model.stage_seconds(first, index - 1, placement[first])
            first = index
    beyond = sum(max(0.0, units - r.units) / r.units for units, r in zip(needed, model.resources, strict=True))
    return -INFEASIBLE_PENALTY - min(beyond, 10.0) - 1e-6


def _rollouts(
    model: CostModel, policy: Any, temperatures: Sequence[float], generator: torch.Generator, reference: float
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """One placement per temperature, all decided together, layer after layer: at 0 the policy's most
    likely type, else a type drawn at that temperature. Also returns what the policy saw, ``(placements,
    layers, observation)``, and the types chosen, ``(placements, layers)``."""
    placements: list[list[int]] = [[] for _ in temperatures]
    heat = torch.tensor(temperatures, dtype=torch.float32).unsqueeze(1)
    seen, chosen = [], []
    for _ in range(model.num_layers):
        inputs = torch.as_tensor(np.stack([observation(model, placement, reference) for placement in placements]))
        with torch.no_grad():
            logits = policy.get_distribution(inputs).distribution.logits[:, : len(model.resources)]
        drawn = torch.multinomial(torch.softmax(logits / heat.clamp(min=1e-6), 1), 1, generator=generator)
        actions = torch.where(heat > 0, drawn, logits.argmax(1, keepdim=True)).squeeze(1)
        for placement, action in zip(placements, actions.tolist(), strict=True):
            placement.append(action)
        seen.append(inputs)
        chosen.append(actions)
    return placements, torch.stack(seen, 1), torch.stack(chosen, 1)
