"""Choosing the MLA prefill backend for a device and model.

An explicit choice -- the ``backend`` argument (pool config, CLI flag) or else
the ``MLAPOOL_PREFILL_BACKEND`` environment variable -- is validated and
raises ``ValueError`` listing every reason it cannot run. Otherwise the
priority list of the device is walked and the first backend with no reasons
wins; the choice and every rejection are logged.

Priorities (fastest first):

=================  ==========================================================
device             order
=================  ==========================================================
cpu                TORCH_SDPA
cuda 9.x (Hopper)  FLASH_ATTN, FLASHINFER, TORCH_SDPA -- measured on H200
                   (benchmarks/results/2026-11-21-h200-attention.json): FA4
                   699-716 TF/s causal at S >= 16K, FlashInfer fa3 681-698,
                   cuDNN through torch 555-589; FA4 also leads non-causal
cuda 10.x          FLASH_ATTN (FA4), TRTLLM_RAGGED, FLASHINFER, TOKENSPEED_MLA,
(Blackwell DC)     TORCH_SDPA -- vLLM's order (FA4 first since its PR 34732);
                   not measured here (no SM100 machine)
other cuda         FLASH_ATTN (FA2), FLASHINFER (fa2), TORCH_SDPA -- not measured
rocm               AITER_FLASH_ATTN, FLASH_ATTN, TORCH_SDPA -- not measured
=================  ==========================================================
"""

from __future__ import annotations

import logging
import os
from functools import cache

from attention.backends.base import DeviceCapability, MLAPrefillBackend, MLAPrefillSelectorConfig
from attention.backends.registry import MLAPrefillBackendEnum, overrides_fingerprint

logger = logging.getLogger(__name__)

ENV_BACKEND = "MLAPOOL_PREFILL_BACKEND"

B = MLAPrefillBackendEnum


def backend_priorities(device: DeviceCapability) -> tuple[MLAPrefillBackendEnum, ...]:
    """Backends to try on ``device``, best first."""
    if device.kind == "cpu":
        return (B.TORCH_SDPA,)
    if device.kind == "rocm":
        return (B.AITER_FLASH_ATTN, B.FLASH_ATTN, B.TORCH_SDPA)
    if device.major == 9:
        return (B.FLASH_ATTN, B.FLASHINFER, B.TORCH_SDPA)
    if device.major == 10:
        return (B.FLASH_ATTN, B.TRTLLM_RAGGED, B.FLASHINFER, B.TOKENSPEED_MLA, B.TORCH_SDPA)
    return (B.FLASH_ATTN, B.FLASHINFER, B.TORCH_SDPA)


def backend_reasons(
    backend: MLAPrefillBackendEnum, device: DeviceCapability, config: MLAPrefillSelectorConfig
) -> tuple[type[MLAPrefillBackend] | None, list[str]]:
    """The backend's class (if importable) and why it cannot serve ``device``/``config``."""
    try:
        cls = backend.get_class()
    except ImportError as exc:
        return None, [f"cannot import {backend.get_path()} ({exc})"]
    return cls, cls.validate_configuration(device, config)


def get_mla_prefill_backend(
    config: MLAPrefillSelectorConfig,
    device: DeviceCapability | None = None,
    backend: MLAPrefillBackendEnum | str | None = None,
) -> type[MLAPrefillBackend]:
    """Select the backend class for ``config`` on ``device`` (default: this process's device).

    ``backend`` (or ``$MLAPOOL_PREFILL_BACKEND`` when ``backend`` is None) forces
    a choice, which must be valid. Raises ``ValueError`` with every reason when
    the forced backend, or every backend of the priority list, cannot run.
    """
    device = device or DeviceCapability.of()
    requested = backend if backend is not None else os.environ.get(ENV_BACKEND) or None
    if requested is not None:
        member = MLAPrefillBackendEnum.parse(requested)
        cls, reasons = backend_reasons(member, device, config)
        if reasons:
            raise ValueError(
                f"MLA prefill backend {member.name} cannot run on {device} with "
                f"{_describe(config)}: " + "; ".join(reasons)
            )
        logger.info("Using %s MLA prefill backend (explicit choice) on %s", member.name, device)
        return cls
    return _auto_select(device, config, overrides_fingerprint())


@cache
def _auto_select(
    device: DeviceCapability, config: MLAPrefillSelectorConfig, _overrides: tuple
) -> type[MLAPrefillBackend]:
    rejected: dict[str, list[str]] = {}
    for member in backend_priorities(device):
        cls, reasons = backend_reasons(member, device, config)
        if not reasons:
            for name, why in rejected.items():
                logger.info("MLA prefill backend %s skipped: %s", name, "; ".join(why))
            logger.info("Using %s MLA prefill backend on %s (%s)", member.name, device, _describe(config))
            return cls
        rejected[member.name] = reasons
    details = " | ".join(f"{name}: {'; '.join(why)}" for name, why in rejected.items())
    raise ValueError(f"no MLA prefill backend can run on {device} with {_describe(config)}: {details}")


def _describe(config: MLAPrefillSelectorConfig) -> str:
    return f"dtype {str(config.dtype).removeprefix('torch.')}, head dims {config.mla_dims}"
