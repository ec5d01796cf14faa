"""Placement: which layers run on which resource type, at the least cost for a throughput target (HeterPS).

:func:`profile_model` measures a model's layers; a catalogue of :class:`ResourceType` says what can be
rented, at what price.
"""

from lightning_dynamix.placement.catalogue import ResourceType, load_catalogue
from lightning_dynamix.placement.profile import LayerProfile, ModelProfile, available_devices, profile_model

__all__ = ["LayerProfile", "ModelProfile", "ResourceType", "available_devices", "load_catalogue", "profile_model"]
