"""Policy files: a policy network's tensors and its JSON metadata in one safetensors file.

A policy file holds only tensors and text: loading one never unpickles anything, so a file from
anywhere cannot run code (stable-baselines3's own zip files are pickles). The metadata, stored as
JSON in the safetensors header under the key ``"lightning_dynamix"``, says what the tensors mean::

    {
      "format": "lightning-dynamix-policy",
      "format_version": 2,
      "network": {"class": "RankPolicyNetwork", "hidden": 64, "layers": 2},
      "observation": {"local_features": [...], "global_features": [...]},
      "action": {"adjustments": [-0.25, -0.1, 0.0, 0.1, 0.25], "applied_to": "pid"},
      "max_world_size": 64,
      "training": {...},            # how it was trained: preset, scenarios, steps, rewards
      "package_version": "0.1.0"
    }

:func:`load_policy` checks all of it against this version of the package and says what differs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from lightning_dynamix.control.ppo.network import ADJUSTMENTS, APPLIED_TO, RankPolicyNetwork
from lightning_dynamix.metrics.state import GLOBAL_FEATURES, LOCAL_FEATURES

FORMAT = "lightning-dynamix-policy"
FORMAT_VERSION = 2  # 2: adjustments apply to the balancer's proposal (1: to the size the rank ran at)
_METADATA_KEY = "lightning_dynamix"
DEFAULT_POLICY = "default"


class PolicyFileError(ValueError):
    """A policy file that cannot be used: corrupt, from another format version, or with another spec."""


@dataclass
class PolicyFile:
    """A loaded policy: its network (in eval mode) and its metadata.

    Attributes:
        network: the policy network with the file's weights.
        max_world_size: the most ranks the policy was trained for.
        training: how the policy was trained (free-form, from the file).
        path: where it was loaded from (``None`` when built in memory).
        package_version: the lightning-dynamix version that wrote it.
    """

    network: RankPolicyNetwork
    max_world_size: int
    training: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    package_version: str = ""

    def metadata(self) -> dict[str, Any]:
        from lightning_dynamix import __version__

        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "network": {"class": "RankPolicyNetwork", "hidden": self.network.hidden, "layers": self.network.layers},
            "observation": {"local_features": list(LOCAL_FEATURES), "global_features": list(GLOBAL_FEATURES)},
            "action": {"adjustments": list(ADJUSTMENTS), "applied_to": APPLIED_TO},
            "max_world_size": self.max_world_size,
            "training": self.training,
            "package_version": __version__,
        }


def save_policy(policy: PolicyFile, path: str | Path) -> Path:
    """Write ``policy`` to ``path`` (a ``.safetensors`` file; parent folders are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().contiguous() for name, t in policy.network.state_dict().items()}
    save_file(tensors, str(path), metadata={_METADATA_KEY: json.dumps(policy.metadata(), sort_keys=True)})
    return path


def default_policy_path() -> Path:
    """The policy that ships with the package (what ``controller="ppo"`` loads)."""
    return Path(str(resources.files("lightning_dynamix.control.ppo") / "policies" / f"{DEFAULT_POLICY}.safetensors"))


def resolve_policy_path(policy: str | Path | None) -> Path:
    """``None`` or ``"default"``: the shipped policy; otherwise the path given."""
    if policy is None or policy == DEFAULT_POLICY:
        return default_policy_path()
    return Path(policy)


def load_policy(policy: str | Path | None = None) -> PolicyFile:
    """Load a policy file without unpickling anything, and check it fits this version of the package.

    Args:
        policy: a path to a ``.safetensors`` policy file; ``None`` or ``"default"`` for the policy
            that ships with the package.

    Raises:
        FileNotFoundError: when the file does not exist.
        PolicyFileError: for a file that is not a policy file or is corrupt, another format
            version, another observation or action spec, or tensors that do not fit the network.
    """
    path = resolve_policy_path(policy)
    if not path.is_file():
        raise FileNotFoundError(
            f"policy file {str(path)!r} does not exist; pass the path of a file written by"
            " `dynamix train-policy`, or 'default' for the policy that ships with lightning-dynamix"
        )
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, ValueError) as error:
        message = f"{path} is not a readable policy file (safetensors could not read it: {error})"
        raise PolicyFileError(message) from None
    if _METADATA_KEY not in header:
        raise PolicyFileError(f"{path} is a safetensors file without lightning-dynamix policy metadata")
    try:
        meta = json.loads(header[_METADATA_KEY])
    except json.JSONDecodeError as error:
        raise PolicyFileError(f"{path}: its policy metadata is not valid JSON ({error})") from None
    _check_metadata(meta, path)
    net = meta["network"]
    network = RankPolicyNetwork(hidden=int(net["hidden"]), layers=int(net["layers"]))
    expected = network.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = sorted(n for n in set(expected) & set(tensors) if tensors[n].shape != expected[n].shape)
    if missing or unexpected or wrong:
        raise PolicyFileError(
            f"{path}: its tensors do not fit a RankPolicyNetwork(hidden={net['hidden']}, layers={net['layers']}):"
            f" missing {missing}, unexpected {unexpected}, wrong shape {wrong}"
        )
    if not all(torch.isfinite(t).all() for t in tensors.values()):
        raise PolicyFileError(f"{path}: some of its weights are not finite (NaN or inf)")
    network.load_state_dict(tensors)
    network.eval()
    return PolicyFile(
        network=network,
        max_world_size=int(meta["max_world_size"]),
        training=dict(meta.get("training") or {}),
        path=path,
        package_version=str(meta.get("package_version", "")),
    )


def _check_metadata(meta: Any, path: Path) -> None:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PolicyFileError(f"{path} is not a lightning-dynamix policy file (format {meta.get('format')!r})")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise PolicyFileError(
            f"{path} has policy format version {version!r}; this version of lightning-dynamix reads version"
            f" {FORMAT_VERSION}. Retrain it with `dynamix train-policy` or use the package version that wrote it"
            f" ({meta.get('package_version', 'unknown')})."
        )
    observation = meta.get("observation") or {}
    for key, names in (("local_features", LOCAL_FEATURES), ("global_features", GLOBAL_FEATURES)):
        if list(observation.get(key, [])) != list(names):
            raise PolicyFileError(
                f"{path} was trained on another observation: its {key} are {observation.get(key)!r}, this"
                f" version of lightning-dynamix observes {list(names)!r}. Retrain it with `dynamix train-policy`."
            )
    action = meta.get("action") or {}
    adjustments = action.get("adjustments")
    if adjustments is None or [float(a) for a in adjustments] != list(ADJUSTMENTS):
        raise PolicyFileError(
            f"{path} chooses among other actions ({adjustments!r}); this version of lightning-dynamix uses"
            f" {list(ADJUSTMENTS)!r}. Retrain it with `dynamix train-policy`."
        )
    if action.get("applied_to") != APPLIED_TO:
        raise PolicyFileError(
            f"{path} applies its adjustments to {action.get('applied_to')!r}; this version of lightning-dynamix"
            f" applies them to the proposal of {APPLIED_TO!r}. Retrain it with `dynamix train-policy`."
        )
    network = meta.get("network") or {}
    if network.get("class") != "RankPolicyNetwork" or not all(
        isinstance(network.get(k), int) and network[k] >= 1 for k in ("hidden", "layers")
    ):
        raise PolicyFileError(f"{path}: unknown network {network!r} (expected RankPolicyNetwork with hidden, layers)")
    size = meta.get("max_world_size")
    if not isinstance(size, int) or size < 1:
        raise PolicyFileError(f"{path}: `max_world_size` must be an int >= 1, got {size!r}")
