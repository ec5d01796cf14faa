"""Policy files: kept so that ``lightning_dynamix.rl.files`` imports keep working.

The code lives in :mod:`lightning_dynamix.control.ppo.files`, beside the controller that loads them
(:class:`~lightning_dynamix.control.PPOController`), and so does the policy that ships with the
package (``lightning_dynamix/control/ppo/policies/default.safetensors``).
"""

from lightning_dynamix.control.ppo.files import (
    DEFAULT_POLICY,
    FORMAT,
    FORMAT_VERSION,
    PolicyFile,
    PolicyFileError,
    default_policy_path,
    load_policy,
    resolve_policy_path,
    save_policy,
)

__all__ = [
    "DEFAULT_POLICY",
    "FORMAT",
    "FORMAT_VERSION",
    "PolicyFile",
    "PolicyFileError",
    "default_policy_path",
    "load_policy",
    "resolve_policy_path",
    "save_policy",
]
