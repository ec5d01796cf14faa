"""The policy network shared by every rank, its actions, and the padded observation it reads.

One network scores each rank from that rank's own features (:data:`LOCAL_FEATURES`), the job's
global features (:data:`GLOBAL_FEATURES`) and a summary of all ranks (masked mean and max of their
features), so the same parameters serve any number of ranks: a policy trained on clusters of up
to 64 ranks decides for 1 rank or 64 without retraining. Its action for a rank is one of
:data:`ADJUSTMENTS`, a relative change of that rank's batch size.

This module needs only torch and numpy: the controller that runs a policy in a real job never
imports stable-baselines3.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from lightning_dynamix.metrics.state import GLOBAL_FEATURES, LOCAL_FEATURES, ClusterState

# relative batch-size changes a policy chooses from, per rank; index 2 keeps the size
ADJUSTMENTS: tuple[float, ...] = (-0.25, -0.10, 0.0, 0.10, 0.25)
KEEP = ADJUSTMENTS.index(0.0)
# logit given to every action but KEEP on padding ranks: their action is then KEEP with
# probability 1 - 1e-13, so they add nothing to log-probabilities or entropy
_PADDING_LOGIT = -30.0


def apply_adjustments(
    batch_sizes: Sequence[int], actions: Sequence[int], lower: Sequence[int], upper: Sequence[int | None]
) -> tuple[int, ...]:
    """New batch sizes from one action index per rank, within per-rank bounds (an upper bound ``None``: none).

    Rank ``r`` gets ``round(b_r * (1 + ADJUSTMENTS[a_r]))``, at least one sample away from ``b_r``
    when the action changes the size, then clamped to the bounds.

    Raises:
        ValueError: when the lengths differ or an action is not an index of :data:`ADJUSTMENTS`.
    """
    if not len(batch_sizes) == len(actions) == len(lower) == len(upper):
        raise ValueError(
            f"got {len(actions)} actions and {len(lower)}/{len(upper)} bounds for {len(batch_sizes)} ranks"
        )
    out = []
    for b, a, low, high in zip(batch_sizes, actions, lower, upper):
        a = int(a)
        if not 0 <= a < len(ADJUSTMENTS):
            raise ValueError(f"an action must be an index in [0, {len(ADJUSTMENTS) - 1}] of ADJUSTMENTS, got {a}")
        change = ADJUSTMENTS[a]
        new = round(b * (1.0 + change))
        if change > 0:
            new = max(new, b + 1)
        elif change < 0:
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
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.Tanh()]
    return nn.Sequential(*layers)


class RankPolicyNetwork(nn.Module):
    """Actor and critic with parameters shared across ranks.

    Args:
        hidden: width of the hidden layers.
        layers: hidden layers in each network (>= 1).

    The actor reads, for each rank, ``[own features, global features, mean and max of all ranks'
    features]`` and returns logits over :data:`ADJUSTMENTS`; the critic embeds each rank the same
    way, pools the embeddings (masked mean and max) and returns one value for the job.
    """

    def __init__(self, hidden: int = 64, layers: int = 2) -> None:
        super().__init__()
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"`hidden` must be an int >= 1, got {hidden!r}")
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"`layers` must be an int >= 1, got {layers!r}")
        self.hidden, self.layers = hidden, layers
        local, cluster = len(LOCAL_FEATURES), len(GLOBAL_FEATURES)
        rank_input = 3 * local + cluster
        self.actor = _mlp([rank_input] + [hidden] * layers)
        self.action_head = nn.Linear(hidden, len(ADJUSTMENTS))
        self.critic_rank = _mlp([rank_input, hidden])
        self.critic = _mlp([2 * hidden + cluster] + [hidden] * layers)
        self.value_head = nn.Linear(hidden, 1)
        for module, gain in ((self.actor, math.sqrt(2)), (self.critic_rank, math.sqrt(2)), (self.critic, math.sqrt(2))):
            for layer in module:
                if isinstance(layer, nn.Linear):
                    nn.init.orthogonal_(layer.weight, gain)
                    nn.init.zeros_(layer.bias)
        nn.init.orthogonal_(self.action_head.weight, 0.01)
        nn.init.zeros_(self.action_head.bias)
        nn.init.orthogonal_(self.value_head.weight, 1.0)
        nn.init.zeros_(self.value_head.bias)

    def _rank_inputs(self, ranks: torch.Tensor, cluster: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1)
        count = m.sum(dim=1).clamp(min=1.0)
        mean = (ranks * m).sum(dim=1) / count
        largest = ranks.masked_fill(m == 0, -1e4).max(dim=1).values
        largest = torch.where(count > 0, largest, torch.zeros_like(largest))
        n = ranks.shape[1]
        pooled = torch.cat([cluster, mean, largest], dim=-1).unsqueeze(1).expand(-1, n, -1)
        return torch.cat([ranks, pooled], dim=-1)

    def logits(self, ranks: torch.Tensor, cluster: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``(batch, ranks, len(ADJUSTMENTS))`` logits; padding ranks (mask 0) always keep their size."""
        out = self.action_head(self.actor(self._rank_inputs(ranks, cluster, mask)))
        padding = torch.full_like(out, _PADDING_LOGIT)
        padding[..., KEEP] = 0.0
        return torch.where(mask.unsqueeze(-1) > 0, out, padding)

    def value(self, ranks: torch.Tensor, cluster: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``(batch, 1)`` value of the job's state."""
        embedded = self.critic_rank(self._rank_inputs(ranks, cluster, mask))
        m = mask.unsqueeze(-1)
        mean = (embedded * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        largest = embedded.masked_fill(m == 0, -1e4).max(dim=1).values
        return self.value_head(self.critic(torch.cat([mean, largest, cluster], dim=-1)))

    @torch.no_grad()
    def act(self, observation: dict[str, np.ndarray]) -> np.ndarray:
        """The most likely action of each rank of one unpadded observation (``ClusterState.observation()``)."""
        ranks = torch.as_tensor(observation["ranks"], dtype=torch.float32).unsqueeze(0)
        cluster = torch.as_tensor(observation["cluster"], dtype=torch.float32).unsqueeze(0)
        mask = torch.ones(ranks.shape[:2])
        return self.logits(ranks, cluster, mask)[0].argmax(dim=-1).numpy()
