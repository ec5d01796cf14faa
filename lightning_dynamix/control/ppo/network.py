"""The policy network shared by every rank, its actions, and the padded observation it reads.

One network scores each rank from that rank's own features (:data:`LOCAL_FEATURES`), the job's
global features (:data:`GLOBAL_FEATURES`) and a summary of all ranks (masked mean and max of their
features), so the same parameters serve any number of ranks: a policy trained on clusters of up
to 64 ranks decides for 1 rank or 64 without retraining.

A decision is ``1 + world_size`` indices into :data:`ADJUSTMENTS` (-25%, -10%, keep, +10%, +25%):
the first, the job's, scales the global batch; each rank's then moves that rank's size. Both
apply to the sizes a balancer proposes (:func:`balancer`, the PID controller at its defaults:
every rank's own step time equal at the current global batch), not to the sizes the ranks ran at,
so the policy is residual: balancing unequal ranks, which one proportional step does at once, is
not something it must rediscover a 25% step at a time. What it learns is what balancing cannot
know: the global batch to run at as the gradient noise scale grows (one decision for the job, so
its reward is not diluted over every rank's independent choice), and moving a rank away from the
balanced split where that pays. Keeping everything is exactly the PID controller, which is also
where training starts (:data:`KEEP_PRIOR`).

This module needs only torch and numpy: the controller that runs a policy in a real job never
imports stable-baselines3 or gymnasium (only fine-tuning does, :mod:`~lightning_dynamix.control.ppo.finetune`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from lightning_dynamix._checks import require_int
from lightning_dynamix._layers import mlp
from lightning_dynamix.control.pid import PIDController
from lightning_dynamix.metrics.state import GLOBAL_FEATURES, LOCAL_FEATURES, ClusterState

# relative batch-size changes a policy chooses from, for the job's global batch and per rank, applied
# to the balancer's proposal; index 2 keeps the proposal
ADJUSTMENTS: tuple[float, ...] = (-0.25, -0.10, 0.0, 0.10, 0.25)
KEEP = ADJUSTMENTS.index(0.0)
# what the adjustments apply to (recorded in policy files: a policy trained on another base is refused)
APPLIED_TO = "pid"
# initial logit of KEEP over the other actions: an untrained policy keeps the balancer's proposal
# (probability e^2 / (e^2 + 4) = 0.65 for the job and each rank) and explores around it
KEEP_PRIOR = 2.0
# a change of the size by at least this fraction moves it by at least one sample
_LEAST_CHANGE = 0.05
# logit given to every action but KEEP on padding ranks: their action is then KEEP with
# probability 1 - 1e-13, so they add nothing to log-probabilities or entropy
_PADDING_LOGIT = -30.0


def balancer(
    min_batch_size: int | Sequence[int] | None = None,
    max_batch_size: int | Sequence[int] | None = None,
    noise_gate: float | None = 3.5,
) -> PIDController:
    """The balancer whose proposals a policy adjusts: :class:`PIDController` at its defaults, within the bounds.

    It keeps the global batch of the sizes the job ran at, so the policy's changes to the global
    batch persist, and moves samples between ranks until their own step times are equal.
    """
    return PIDController(min_batch_size=min_batch_size, max_batch_size=max_batch_size, noise_gate=noise_gate)


def apply_adjustments(
    batch_sizes: Sequence[int], actions: Sequence[int], lower: Sequence[int], upper: Sequence[int | None]
) -> tuple[int, ...]:
    """New batch sizes from a decision's actions, within per-rank bounds (an upper bound ``None``: none).

    Args:
        batch_sizes: the sizes the adjustments apply to (the balancer's proposal), one per rank.
        actions: ``1 + len(batch_sizes)`` indices into :data:`ADJUSTMENTS`: the job's, then one per rank.
        lower: smallest size per rank.
        upper: largest size per rank, ``None`` for none.

    Rank ``r`` gets ``round(b_r * f)`` with ``f = (1 + ADJUSTMENTS[a_job]) * (1 + ADJUSTMENTS[a_r])``,
    at least one sample away from ``b_r`` when ``f`` changes it by 5% or more (so that small ranks
    can move at all, while a job's +10% and a rank's -10% keep it), then clamped to its bounds.

    Raises:
        ValueError: when the lengths differ or an action is not an index of :data:`ADJUSTMENTS`.
    """
    if not len(actions) == len(batch_sizes) + 1 or not len(batch_sizes) == len(lower) == len(upper):
        raise ValueError(
            f"got {len(actions)} actions (1 for the job + 1 per rank) and {len(lower)}/{len(upper)} bounds"
            f" for {len(batch_sizes)} ranks"
        )
    for a in actions:
        if not 0 <= int(a) < len(ADJUSTMENTS):
            raise ValueError(f"an action must be an index in [0, {len(ADJUSTMENTS) - 1}] of ADJUSTMENTS, got {a}")
    job = 1.0 + ADJUSTMENTS[int(actions[0])]
    out = []
    for b, a, low, high in zip(batch_sizes, actions[1:], lower, upper):
        factor = job * (1.0 + ADJUSTMENTS[int(a)])
        new = round(b * factor)
        if factor >= 1.0 + _LEAST_CHANGE:
            new = max(new, b + 1)
        elif factor <= 1.0 - _LEAST_CHANGE:
            new = min(new, b - 1)
        new = max(new, low)
        out.append(new if high is None else min(new, high))
    return tuple(out)


def padded_observation(state: ClusterState, max_world_size: int) -> dict[str, np.ndarray]:
    """``state.observation()`` with the rank rows padded to ``max_world_size`` and a mask of the real ranks.

    Returns:
        ``{"ranks": (max_world_size, L), "cluster": (G,), "mask": (max_world_size,)}``, float32.

    Raises:
        ValueError: when the state has more ranks than ``max_world_size``.
    """
    n = state.world_size
    if n > max_world_size:
        raise ValueError(f"the state has {n} ranks, more than the policy's max_world_size={max_world_size}")
    obs = state.observation()
    ranks = np.zeros((max_world_size, len(LOCAL_FEATURES)), dtype=np.float32)
    ranks[:n] = obs["ranks"]
    mask = np.zeros(max_world_size, dtype=np.float32)
    mask[:n] = 1.0
    return {"ranks": ranks, "cluster": obs["cluster"], "mask": mask}


def _mlp(sizes: Sequence[int]) -> nn.Sequential:
    return mlp(sizes, activation=nn.Tanh, final_activation=True)


class RankPolicyNetwork(nn.Module):
    """Actor and critic with parameters shared across ranks.

    Args:
        hidden: width of the hidden layers.
        layers: hidden layers in each network (>= 1).

    The actor reads, for each rank, ``[own features, global features, mean and max of all ranks'
    features]`` and returns logits over :data:`ADJUSTMENTS`; the job's actor reads the global
    features and the mean and max and returns the job's logits; the critic embeds each rank like
    the actor, pools the embeddings (masked mean and max) and returns one value for the job.
    """

    def __init__(self, hidden: int = 64, layers: int = 2) -> None:
        super().__init__()
        require_int("hidden", hidden, 1)
        require_int("layers", layers, 1)
        self.hidden, self.layers = hidden, layers
        local, cluster = len(LOCAL_FEATURES), len(GLOBAL_FEATURES)
        rank_input = 3 * local + cluster
        self.actor = _mlp([rank_input] + [hidden] * layers)
        self.action_head = nn.Linear(hidden, len(ADJUSTMENTS))
        self.job_actor = _mlp([2 * local + cluster] + [hidden] * layers)
        self.job_head = nn.Linear(hidden, len(ADJUSTMENTS))
        self.critic_rank = _mlp([rank_input, hidden])
        self.critic = _mlp([2 * hidden + cluster] + [hidden] * layers)
        self.value_head = nn.Linear(hidden, 1)
        for module in (self.actor, self.job_actor, self.critic_rank, self.critic):
            for layer in module:
                if isinstance(layer, nn.Linear):
                    nn.init.orthogonal_(layer.weight, math.sqrt(2))
                    nn.init.zeros_(layer.bias)
        for head in (self.action_head, self.job_head):
            nn.init.orthogonal_(head.weight, 0.01)
            nn.init.zeros_(head.bias)
            with torch.no_grad():
                head.bias[KEEP] = KEEP_PRIOR
        nn.init.orthogonal_(self.value_head.weight, 1.0)
        nn.init.zeros_(self.value_head.bias)

    @staticmethod
    def _pooled(ranks: torch.Tensor, cluster: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[global features, masked mean, masked max of the rank rows]`` per job."""
        m = mask.unsqueeze(-1)
        count = m.sum(dim=1).clamp(min=1.0)
        mean = (ranks * m).sum(dim=1) / count
        largest = ranks.masked_fill(m == 0, -1e4).max(dim=1).values
        largest = torch.where(count > 0, largest, torch.zeros_like(largest))
        return torch.cat([cluster, mean, largest], dim=-1)

    def _rank_inputs(self, ranks: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return torch.cat([ranks, pooled.unsqueeze(1).expand(-1, ranks.shape[1], -1)], dim=-1)

    def logits(self, ranks: torch.Tensor, cluster: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``(batch, 1 + ranks, len(ADJUSTMENTS))`` logits: the job's first, then each rank's.

        Padding ranks (mask 0) always keep their size.
        """
        pooled = self._pooled(ranks, cluster, mask)
        per_rank = self.action_head(self.actor(self._rank_inputs(ranks, pooled)))
        padding = torch.full_like(per_rank, _PADDING_LOGIT)
        padding[..., KEEP] = 0.0
        per_rank = torch.where(mask.unsqueeze(-1) > 0, per_rank, padding)
        job = self.job_head(self.job_actor(pooled)).unsqueeze(1)
        return torch.cat([job, per_rank], dim=1)

    def value(self, ranks: torch.Tensor, cluster: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``(batch, 1)`` value of the job's state."""
        embedded = self.critic_rank(self._rank_inputs(ranks, self._pooled(ranks, cluster, mask)))
        m = mask.unsqueeze(-1)
        mean = (embedded * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        largest = embedded.masked_fill(m == 0, -1e4).max(dim=1).values
        return self.value_head(self.critic(torch.cat([mean, largest, cluster], dim=-1)))

    @torch.no_grad()
    def act(self, observation: dict[str, np.ndarray]) -> np.ndarray:
        """The most likely actions, the job's then each rank's, for one unpadded ``ClusterState.observation()``."""
        ranks = torch.as_tensor(observation["ranks"], dtype=torch.float32).unsqueeze(0)
        cluster = torch.as_tensor(observation["cluster"], dtype=torch.float32).unsqueeze(0)
        mask = torch.ones(ranks.shape[:2])
        return self.logits(ranks, cluster, mask)[0].argmax(dim=-1).numpy()
