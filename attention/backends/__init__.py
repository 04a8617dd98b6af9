"""MLA prefill backends: the contract, the registry and the selector."""

from attention.backends.base import (
    DEEPSEEK_MLA_DIMS,
    BackendCapabilities,
    DeviceCapability,
    MLADimensions,
    MLAPrefillBackend,
    MLAPrefillSelectorConfig,
)
from attention.backends.registry import MLAPrefillBackendEnum, register_mla_prefill_backend
from attention.backends.selector import get_mla_prefill_backend

__all__ = [
    "DEEPSEEK_MLA_DIMS",
    "BackendCapabilities",
    "DeviceCapability",
    "MLADimensions",
    "MLAPrefillBackend",
    "MLAPrefillBackendEnum",
    "MLAPrefillSelectorConfig",
    "get_mla_prefill_backend",
    "register_mla_prefill_backend",
]
