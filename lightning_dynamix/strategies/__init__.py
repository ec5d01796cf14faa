"""Lightning strategies; importing this package registers their names with Lightning."""

from lightning_dynamix.strategies.heterogeneous_ddp import HeterogeneousDDPStrategy

__all__ = ["HeterogeneousDDPStrategy"]
