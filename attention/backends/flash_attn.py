"""FLASH_ATTN: flash-attention's varlen kernels -- FA3, FA4 or FA2, whichever is installed.

=======  ==========================  ===========================  ==========
version  module                      hardware                     V padding
=======  ==========================  ===========================  ==========
3        ``flash_attn_interface``    SM90                         none
4        ``flash_attn.cute``         SM90, SM100                  none
2        ``flash_attn``              SM80+                        128 -> 192
=======  ==========================  ===========================  ==========

The default order is 3, 4, 2 on SM90, 4, 2 on SM100 and 2 elsewhere; the
``version`` argument pins one. FA2 needs V padded to the QK head dim; the
padding is sliced off before returning. All return LSE as natural-log
``[H, T]``; rows that see no key are rewritten to ``o = 0, lse = -inf``
(FA2 reports ``+inf`` there).
"""

from __future__ import annotations

import importlib
import warnings

import torch.nn.functional as F

from attention.backends.base import (
    BackendCapabilities,
    DeviceCapability,
    MLAPrefillBackend,
    MLAPrefillSelectorConfig,
)

MODULES = {3: "flash_attn_interface", 4: "flash_attn.cute", 2: "flash_attn"}


def default_versions(major: int) -> tuple[int, ...]:
    return {9: (3, 4, 2), 10: (4, 2)}.get(major, (2,))


def _importable(version: int) -> bool:
    """Whether this flash-attention version's varlen function can be imported (flash-attn-4
    also installs a ``flash_attn`` package, without FA2's function)."""
    try:
        module = importlib.import_module(MODULES[version])
    except Exception:  # noqa: BLE001 -- any import failure means "not this version"
        return False
    return hasattr(module, "flash_attn_varlen_func")


class FlashAttnPrefillBackend(MLAPrefillBackend):
    name = "FLASH_ATTN"
    capabilities = BackendCapabilities(device_kinds=("cuda",), min_capability=(8, 0))

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        if any(_importable(v) for v in MODULES):
            return []
        return ["no flash-attention module can be imported (" + ", ".join(MODULES.values()) + ")"]

    @classmethod
    def validate_configuration(
        cls, device_capability: DeviceCapability, selector_config: MLAPrefillSelectorConfig
    ) -> list[str]:
        reasons = cls.capabilities.reasons(device_capability, selector_config)  # no import unless it fits
        if not reasons:
            reasons = cls.unavailable_reasons()
        if not reasons and not any(_importable(v) for v in default_versions(device_capability.major)):
            reasons.append(
                f"no flash-attention version for compute capability {device_capability.major}.x is installed"
            )
        return reasons

    def __init__(self, *, version: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        if version is not None and version not in MODULES:
            raise ValueError(f"flash-attention version must be one of {sorted(MODULES)}, got {version}")
        major = DeviceCapability.of(self.device).major
        candidates = (version,) if version is not None else default_versions(major)
        found = [v for v in candidates if _importable(v)]
        if not found:
            raise ValueError(f"flash-attention {candidates} cannot be imported on this node (modules {MODULES})")
        self.version = found[0]
        self._varlen = importlib.import_module(MODULES[self.version]).flash_attn_varlen_func
        if self.version == 4:
            # FA4 hands the CuTe DSL an argument (AuxData) it cannot convert and does not use here: a
            # screenful of UserWarning per compiled kernel, nothing wrong with the kernel
            warnings.filterwarnings("ignore", message=r"Argument aux_data .* cannot be converted", category=UserWarning)

    def _forward(self, q, k, v, plan, return_lse):
        v_dim = self.dims.v_head_dim
        pad = self.version == 2 and v_dim != self.dims.qk_head_dim
        if pad:
            v = F.pad(v, (0, self.dims.qk_head_dim - v_dim))
        common = plan.varlen_kwargs(self.scale)
        if self.version == 4:
            out, lse = self._varlen(q, k, v, return_lse=True, **common)
        else:
            out, lse, *_ = self._varlen(q, k, v, return_attn_probs=True, **common)
        if pad:
            out = out[..., :v_dim]
        lse = lse.float()
        return out, (lse if return_lse else None)
