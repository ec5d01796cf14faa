"""DYNAMIX: a learned policy decides every rank's batch size from the cluster's signals.

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/control/ppo/controller.py``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_dynamix._checks import require_bool, require_number
from lightning_dynamix.control.allocation import (
    resolve_bounds,
    split_in_proportion,
    validate_bound,
    validate_bound_pair,
)
from lightning_dynamix.control.base import Decision
from lightning_dynamix.control.ppo.files import PolicyFile, load_policy
from lightning_dynamix.control.ppo.network import KEEP, apply_adjustments, balancer
from lightning_dynamix.metrics.state import ClusterState, MeanWork

log = logging.getLogger(__name__)


class PPOController:
    """Per-rank batch sizes from a trained policy file.

    Args:
        policy: a policy file written by ``dynamix train-policy`` (a path), ``"default"`` for the
            policy that ships with the package, or a loaded :class:`~lightning_dynamix.control.ppo.files.PolicyFile`.
        deterministic: take each rank's most likely action (the default); ``False`` samples
            actions (seeded by ``seed``), which explores.
        min_batch_size: the smallest size any rank may be given, or one per rank; ``None`` (default)
            for the state's alone (the strategy's); 0 lets a rank sit out.
        max_batch_size: the largest size any rank may be given, or one per rank; ``None`` for the
            state's bound only. Give the ranks' memory limits here: the policy cannot know them.
        seed: seeds sampled actions.
        finetune: keep training the policy on this job's own decisions (PPO updates on rank 0,
            see :mod:`lightning_dynamix.control.ppo.finetune`); adjustments are then sampled, not the most
            likely ones, and the updated weights are saved with the checkpoint.
        finetune_kwargs: arguments of :class:`~lightning_dynamix.control.ppo.finetune.OnlineFinetuner`
            (``n_steps``, ``learning_rate``, ``n_epochs``, ``batch_size``, ``gamma``, ``clip_range``).
        keep_global_batch: never change the global batch (the job's action is taken as "keep", and the
            ranks' adjustments are scaled back to the balancer's total): the policy only moves samples
            between ranks.
        fallback_tolerance: use the balancer's split of the policy's global batch where the policy's
            split is predicted to make the step longer by more than this fraction, or cannot be
            judged yet (the confidence fallback of the module docstring), >= 0; ``None`` always
            follows the policy.
        noise_gate: keep the sizes where a move at the same global batch answers no deviation measured
            beyond this many standard errors of the measurements' noise (pid's gate; the balancer's proposals
            are gated alike; the module docstring), >= 0; ``None`` moves wherever the policy and the
            balancer say.

    Raises:
        FileNotFoundError: when the policy file does not exist.
        PolicyFileError: (a ``ValueError``) for a corrupt file or one of another format or spec.
        ValueError: for bad bounds.
    """

    @property
    def needs_gradient_noise_scale(self) -> bool:
        """Whether the policy chooses the global batch (from the noise scale among the rest) or is finetuned
        (its reward counts statistical efficiency); with ``keep_global_batch`` alone it does without it."""
        return not self.keep_global_batch or self.finetuner is not None

    def __init__(
        self,
        policy: str | Path | PolicyFile = "default",
        deterministic: bool = True,
        min_batch_size: int | tuple[int, ...] | None = None,
        max_batch_size: int | tuple[int, ...] | None = None,
        seed: int = 0,
        finetune: bool = False,
        finetune_kwargs: dict[str, Any] | None = None,
        keep_global_batch: bool = False,
        fallback_tolerance: float | None = 0.0,
        noise_gate: float | None = 3.5,
    ) -> None:
        require_bool("deterministic", deterministic)
        require_bool("finetune", finetune)
        if finetune_kwargs and not finetune:
            raise ValueError(f"`finetune_kwargs` {finetune_kwargs!r} given without finetune=True")
        require_bool("keep_global_batch", keep_global_batch)
        self.keep_global_batch = keep_global_batch
        if fallback_tolerance is not None:
            fallback_tolerance = require_number(
                "fallback_tolerance", fallback_tolerance, 0.0, math.inf, low_open=False, high_open=True
            )
        self.fallback_tolerance = fallback_tolerance
        self.fallbacks = 0
        self.held = 0
        if noise_gate is not None:
            noise_gate = require_number("noise_gate", noise_gate, 0.0, math.inf, low_open=False, high_open=True)
        self.noise_gate = noise_gate
        self.min_batch_size = validate_bound(min_batch_size, "min_batch_size", allow_none=True, low=0)
        self.max_batch_size = validate_bound(max_batch_size, "max_batch_size", allow_none=True)
        validate_bound_pair(self.min_batch_size, self.max_batch_size)
        if isinstance(policy, PolicyFile):
            self.policy = policy
        elif isinstance(policy, str | Path):
            self.policy = load_policy(policy)
        else:
            raise ValueError(
                "`policy` must be a policy file path, 'default' or a PolicyFile,"
                f" got {type(policy).__name__}: {policy!r}"
            )
        self.deterministic = deterministic
        self.balancer = balancer(self.min_batch_size, self.max_batch_size, noise_gate=noise_gate)
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self._warned: set[str] = set()
        self.decisions = 0
        self.base_global_batch: int | None = None
        self._work = MeanWork()
        self.finetuner = None
        if finetune:
            # stable-baselines3 and gymnasium are imported only by a controller that fine-tunes
            from lightning_dynamix.control.ppo.finetune import OnlineFinetuner

            try:
                self.finetuner = OnlineFinetuner(
                    self.policy.network, self.policy.max_world_size, seed=seed, **(finetune_kwargs or {})
                )
            except TypeError as error:
                raise ValueError(f"bad `finetune_kwargs` {finetune_kwargs!r}: {error}") from None

    @property
    def max_world_size(self) -> int:
        """The most ranks the policy was trained for."""
        return self.policy.max_world_size

    def check_world_size(self, world_size: int) -> None:
        """Raise before training when the job has more ranks than the policy was trained for."""
        if world_size > self.max_world_size:
            where = self.policy.path or "the policy given"
            raise ValueError(
                f"PPOController: the job has {world_size} ranks but the policy ({where}) was trained for at most"
                f" {self.max_world_size}; train one for this size with `dynamix train-policy --max-world-size"
                f" {world_size}` or use controller='pid' or 'goodput'"
            )

    def decide(self, state: ClusterState) -> Decision:
        """The policy's sizes for ``state``; the current sizes where the policy cannot decide (see the module)."""
        state = self._work.observe(state)  # times per unit of work where ranks counted it (a language model's tokens)
        current = state.batch_sizes
        if state.world_size > self.max_world_size:
            self._warn_once(
                "world_size",
                "PPOController: %d ranks, more than the %d the policy was trained for; keeping the current sizes",
                state.world_size,
                self.max_world_size,
            )
            return Decision(current)
        observation = state.observation()
        if not all(np.isfinite(v).all() for v in observation.values()):
            message = "PPOController: the observation at step %d is not finite; keeping the sizes"
            self._warn_once("finite", message, state.step)
            return Decision(current)
        if self.base_global_batch is None:
            self.base_global_batch = state.global_batch
        if self.finetuner is not None:
            actions = self.finetuner.act(state, self.base_global_batch)
        else:
            actions = self.act(observation)
        if self.keep_global_batch:
            actions = np.array(actions, copy=True)
            actions[0] = KEEP
        proposal = self.balancer.decide(state).batch_sizes
        lower, upper = resolve_bounds(state, self.min_batch_size, self.max_batch_size)
        self.decisions += 1
        sizes = apply_adjustments(proposal, actions, lower, upper)
        if self.keep_global_batch and sum(sizes) != sum(proposal):  # the ranks' moves, at the same total
            sizes = split_in_proportion(sum(proposal), sizes, lower, upper)
        sizes = self._confident(sizes, proposal, lower, upper)
        if (
            sizes != current
            and sum(sizes) == sum(current)
            and all(lo <= b and (hi is None or b <= hi) for b, lo, hi in zip(current, lower, upper))
            and self.balancer.within_noise(current, sizes)
        ):
            self.held += 1
            return Decision(current)
        return Decision(sizes)

    def _confident(
        self, sizes: tuple[int, ...], proposal: tuple[int, ...], lower: list[int], upper: list[int | None]
    ) -> tuple[int, ...]:
        """``sizes``, or the balancer's split of their total where that is measurably faster or the
        policy's cannot be judged yet (see the module)."""
        if self.fallback_tolerance is None or sizes == proposal:
            return sizes
        total = sum(sizes)
        balanced = self.balancer.balanced_split(total, lower, upper)
        policy_step = self.balancer.predicted_step(sizes)
        if balanced is not None and policy_step is not None:
            balanced_step = self.balancer.predicted_step(balanced)
            assert balanced_step is not None  # the same models
            if balanced == sizes or policy_step <= (1.0 + self.fallback_tolerance) * balanced_step:
                return sizes
        else:  # nothing measured to judge by: the balancer's proposal, at the policy's global batch
            balanced = split_in_proportion(total, proposal, lower, upper)
        if balanced == sizes:
            return sizes
        self.fallbacks += 1
        return balanced

    @torch.no_grad()
    def act(self, observation: dict[str, np.ndarray]) -> np.ndarray:
        """Action indices for an (unpadded) observation: the job's, then one per rank."""
        if self.deterministic:
            return self.policy.network.act(observation)
        ranks = torch.as_tensor(observation["ranks"]).unsqueeze(0)
        cluster = torch.as_tensor(observation["cluster"]).unsqueeze(0)
        logits = self.policy.network.logits(ranks, cluster, torch.ones(ranks.shape[:2]))[0]
        return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=self._generator).squeeze(-1).numpy()

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message + " (shown once)", *args)

    def regroup(self, previous: Sequence[int | None]) -> None:
        """The job now runs on another group (see :meth:`PIDController.regroup`): the balancer keeps the
        speeds of the machines that stay; a fine-tuning transition begun on the old group is dropped."""
        self.balancer.regroup(previous)
        if self.finetuner is not None:
            self.finetuner.regroup()

    def rank_speeds(self) -> list[float] | None:
        """The balancer's smoothed speed of every rank, samples/s; ``None`` before the first measurement."""
        return self.balancer.rank_speeds()

    def state_dict(self) -> dict[str, Any]:
        state = {
            "decisions": self.decisions,
            "fallbacks": self.fallbacks,
            "held": self.held,
            "generator": self._generator.get_state().tolist(),
            "warned": sorted(self._warned),
            "base_global_batch": self.base_global_batch,
            "balancer": self.balancer.state_dict(),
            "work": self._work.state_dict(),
        }
        if self.finetuner is not None:
            state["finetune"] = self.finetuner.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.decisions = int(state_dict["decisions"])
        self.fallbacks = int(state_dict.get("fallbacks", 0))
        self.held = int(state_dict.get("held", 0))
        self._generator.set_state(torch.tensor(state_dict["generator"], dtype=torch.uint8))
        self._warned = set(state_dict.get("warned", []))
        self.base_global_batch = state_dict.get("base_global_batch")
        self.balancer.load_state_dict(state_dict["balancer"])
        self._work.load_state_dict(state_dict.get("work", {}))
        if self.finetuner is not None and "finetune" in state_dict:
            self.finetuner.load_state_dict(state_dict["finetune"])
