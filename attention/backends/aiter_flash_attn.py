"""AITER_FLASH_ATTN: AMD AITER's varlen flash attention (ROCm, MI300 and newer).

Calls ``aiter.flash_attn_varlen_func`` with Q/K 192 and V 128 natively; its LSE
is already natural-log ``[H, T]``. Not yet run on ROCm hardware by this
project (see docs/backends.md).
"""

from __future__ import annotations

from attention.backends.base import BackendCapabilities, MLAPrefillBackend


class AiterFlashAttnPrefillBackend(MLAPrefillBackend):
    name = "AITER_FLASH_ATTN"
    capabilities = BackendCapabilities(device_kinds=("rocm",), min_capability=(9, 4), requires=("aiter",))

    def _forward(self, q, k, v, plan, return_lse):
        import aiter

        out, lse_HT = aiter.flash_attn_varlen_func(q, k, v, return_lse=True, **plan.varlen_kwargs(self.scale))
        lse_HT = lse_HT.float()
        return out, (lse_HT if return_lse else None)
