"""FLASHINFER: FlashInfer's ragged prefill (``BatchPrefillWithRaggedKVCacheWrapper``).

Q/K keep head dim 192 and V 128 (``head_dim_qk``/``head_dim_vo``), no padding.
Only DeepSeek's head dims are declared: FlashInfer 0.7.2 rejects e.g. 48/24 at
run time ("Invalid configuration"), so other models are refused at selection.

Every planned wrapper owns its float workspace. A 2026-11-21 measurement
blamed one workspace shared by the new-token and context-chunk wrappers for
5.4% instead of 1.9% max error on two 8K chunks; on 2026-11-23 such chunked
errors were traced to our own merge (``attention.merge_triton``), which is the
likelier cause of that one too. Separate workspaces only cost memory and stay:
a batch's plans are dropped when the next batch is planned, so the workspaces
held are (1 + context chunks) x ``workspace_bytes``.
The wrapper is planned once per batch shape and dtype and run per layer;
FlashInfer picks its ``fa3`` template on SM90 and ``fa2`` elsewhere
(``backend="auto"``). Its LSE is base-2 ``[T, H]``; it is returned as the
natural-log ``[H, T]`` view ``lse.T * ln 2``. The first plan of a new shape
JIT-compiles the kernel (about a minute on H200); the first plan of each
dtype and head dims in a process is logged with its duration.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from attention.backends.base import (
    DEEPSEEK_MLA_DIMS,
    BackendCapabilities,
    MLAPrefillBackend,
    RaggedPlan,
)

logger = logging.getLogger(__name__)
_PLANNED: set = set()  # (dtype, dims) planned in this process, to log the first (JIT) plan


class FlashInferPrefillBackend(MLAPrefillBackend):
    name = "FLASHINFER"
    capabilities = BackendCapabilities(
        device_kinds=("cuda",), min_capability=(8, 0), mla_dims=(DEEPSEEK_MLA_DIMS,), requires=("flashinfer",)
    )
    workspace_bytes = 128 << 20
    max_cached_plans = 16  # each holds a workspace
    template = "auto"

    def _build_state(self, plan: RaggedPlan) -> dict:
        return {}  # one planned wrapper per dtype, built on the first run of that dtype

    def _wrapper(self, plan: RaggedPlan, dtype: torch.dtype):
        wrapper = plan.state.get(dtype)
        if wrapper is None:
            import flashinfer

            workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=self.device)
            wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=self.template)
            first = (dtype, self.dims) not in _PLANNED
            if first:
                logger.info(
                    "FlashInfer: first plan of ragged prefill for %s, head dims %s in this process; a kernel not yet "
                    "in FlashInfer's JIT cache is compiled now (about a minute on H200)",
                    dtype, self.dims,
                )
            started = time.perf_counter()
            wrapper.plan(
                qo_indptr=plan.cu_seqlens_q.cpu(),
                kv_indptr=plan.cu_seqlens_k.cpu(),
                num_qo_heads=self.num_heads,
                num_kv_heads=self.num_heads,
                head_dim_qk=self.dims.qk_head_dim,
                head_dim_vo=self.dims.v_head_dim,
                causal=plan.causal,
                sm_scale=self.scale,
                q_data_type=dtype,
                kv_data_type=dtype,
            )
            if first:
                logger.info("FlashInfer: planned in %.1f s", time.perf_counter() - started)
                _PLANNED.add((dtype, self.dims))
            plan.state[dtype] = wrapper
        return wrapper

    def _forward(self, q, k, v, plan, return_lse):
        wrapper = self._wrapper(plan, q.dtype)
        if not return_lse:
            return wrapper.run(q, k.contiguous(), v.contiguous()), None
        out, lse_TH = wrapper.run(q, k.contiguous(), v.contiguous(), return_lse=True)
        lse_HT = lse_TH.t() * math.log(2.0)
        return out, lse_HT
