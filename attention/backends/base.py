"""The MLA prefill backend contract.

Legend: T query tokens of a ragged batch (packed), S key tokens, B sequences,
H heads on this rank, Dqk = qk_nope + qk_rope (192 for DeepSeek), Dv = v head
dim (128). Tensors are named with their layout where it matters: ``q_THD``,
``lse_HT``.

Math, per sequence b, head h and query i over its visible keys j:

    s_ij  = scale * <q_i, k_j>
    lse_i = log sum_j exp(s_ij)                 natural log, float32
    o_i   = sum_j exp(s_ij - lse_i) * v_j

A query that sees no key has ``lse = -inf`` and ``o = 0``. Causal masks are
bottom-right aligned: with ``q_len`` queries over ``kv_len`` keys, query i
sees keys ``j <= i + (kv_len - q_len)``; a query left of the diagonal sees
nothing.

A backend is two things:

* a class-level declaration: a frozen :class:`BackendCapabilities` record
  from which :meth:`MLAPrefillBackend.validate_configuration` derives the
  human-readable reasons a backend cannot serve a device/config;
* an instance per (heads, scale, dims, device) that runs attention.
  :meth:`~MLAPrefillBackend.plan` is called once per batch (it copies the
  lengths to the host and builds whatever the kernel library wants, e.g. a
  planned FlashInfer wrapper); :meth:`~MLAPrefillBackend.run_prefill_new_tokens`
  and :meth:`~MLAPrefillBackend.run_prefill_context_chunk` are called once per
  layer with the same ``cu_seqlens`` tensors and reuse the plan.
"""

from __future__ import annotations

import importlib
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any, ClassVar, NamedTuple

import torch

logger = logging.getLogger(__name__)

DEVICE_KINDS = ("cpu", "cuda", "rocm")


@dataclass(frozen=True, kw_only=True)
class MLADimensions:
    """Per-head dimensions of an MLA model's attention after up-projection."""

    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def __str__(self) -> str:
        return f"(nope={self.qk_nope_head_dim}, rope={self.qk_rope_head_dim}, v={self.v_head_dim})"


DEEPSEEK_MLA_DIMS = MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


@dataclass(frozen=True)
class DeviceCapability:
    """What a backend is validated against: device kind and compute capability."""

    kind: str
    major: int = 0
    minor: int = 0

    def __post_init__(self) -> None:
        if self.kind not in DEVICE_KINDS:
            raise ValueError(f"device kind {self.kind!r} is not one of {DEVICE_KINDS}")

    @classmethod
    def of(cls, device: torch.device | str | None = None) -> DeviceCapability:
        """Capability of ``device``; ``None`` means the current CUDA device, else CPU."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cpu":
            return cls("cpu")
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            return cls("rocm" if torch.version.hip else "cuda", major, minor)
        raise ValueError(f"unsupported device type {device.type!r}; valid: cpu, cuda")

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"{self.kind} {self.major}.{self.minor}"


class MLAPrefillSelectorConfig(NamedTuple):
    """Hashable model facts that backend selection depends on."""

    dtype: torch.dtype
    mla_dims: MLADimensions


@dataclass(frozen=True, kw_only=True)
class BackendCapabilities:
    """What a backend can serve. Empty ``mla_dims`` means any head dims.

    ``min_capability``/``max_capability`` (inclusive) apply to GPU kinds only.
    ``requires`` lists importable modules; the first one that fails to import
    makes the backend unavailable, with the import error as the reason. They are
    imported only when everything else fits: importing a kernel library takes
    seconds (FA4 and FlashInfer about 8 s each on an H200 node), which a worker
    that would reject it anyway (another dtype, say) must not spend.
    """

    device_kinds: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    min_capability: tuple[int, int] | None = None
    max_capability: tuple[int, int] | None = None
    mla_dims: tuple[MLADimensions, ...] = ()
    requires: tuple[str, ...] = ()

    def reasons(self, device: DeviceCapability, config: MLAPrefillSelectorConfig) -> list[str]:
        reasons = []
        if device.kind not in self.device_kinds:
            reasons.append(f"runs on {'/'.join(self.device_kinds)} devices, not on {device}")
        elif device.kind != "cpu":
            cap = (device.major, device.minor)
            low, high = self.min_capability, self.max_capability
            if (low and cap < low) or (high and cap > high):
                bounds = f"{_cap(low) if low else 'any'} to {_cap(high) if high else 'any'}"
                reasons.append(f"compute capability {_cap(cap)} is outside the supported range {bounds}")
        if config.dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            reasons.append(f"dtype {str(config.dtype).removeprefix('torch.')} not supported (supported: {names})")
        if self.mla_dims and config.mla_dims not in self.mla_dims:
            reasons.append(
                f"MLA head dims {config.mla_dims} not supported (supported: {', '.join(map(str, self.mla_dims))})"
            )
        if not reasons:
            reasons.extend(_import_failures(self.requires))
        return reasons


def _cap(cap: tuple[int, int]) -> str:
    return f"{cap[0]}.{cap[1]}"


@cache
def _import_failures(modules: tuple[str, ...]) -> tuple[str, ...]:
    """Import each module once; return a reason per module that failed."""
    failures = []
    for name in modules:
        try:
            importlib.import_module(name)
        # A kernel library can fail at import with OSError/RuntimeError (missing
        # CUDA libraries) as well as ImportError; every failure becomes a reason.
        except Exception as exc:  # noqa: BLE001
            failures.append(f"module {name!r} cannot be imported ({type(exc).__name__}: {exc})")
    return tuple(failures)


@dataclass(frozen=True)
class RaggedPlan:
    """Per-batch metadata for one ragged attention call shape, shared by all layers.

    ``state`` holds whatever the backend's :meth:`MLAPrefillBackend._build_state`
    returned (a planned kernel wrapper, say).
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]
    causal: bool
    state: Any = field(default=None, compare=False)

    @property
    def max_seqlen_q(self) -> int:
        return max(self.seqlens_q, default=0)

    @property
    def max_seqlen_k(self) -> int:
        return max(self.seqlens_k, default=0)

    def varlen_kwargs(self, softmax_scale: float) -> dict[str, Any]:
        """The keyword arguments of flash-attention-style ``*_varlen_func`` calls."""
        return dict(
            cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.cu_seqlens_k,
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.max_seqlen_k,
            softmax_scale=softmax_scale,
            causal=self.causal,
        )

    @property
    def blind_query_rows(self) -> tuple[slice, ...]:
        """Query rows that see no key: all of a sequence with no keys, and under
        the bottom-right causal mask the first ``q_len - kv_len`` of a longer one."""
        rows, start = [], 0
        for q_len, kv_len in zip(self.seqlens_q, self.seqlens_k):
            blind = q_len if kv_len == 0 else (max(0, q_len - kv_len) if self.causal else 0)
            if blind:
                rows.append(slice(start, start + blind))
            start += q_len
        return tuple(rows)

    @property
    def num_q_tokens(self) -> int:
        return sum(self.seqlens_q)

    @property
    def num_k_tokens(self) -> int:
        return sum(self.seqlens_k)


class MLAPrefillBackend(ABC):
    """Base class of MLA prefill backends (see the module docstring for the contract).

    Subclasses set ``name`` and ``capabilities`` and implement :meth:`_forward`;
    those that need per-batch kernel state override :meth:`_build_state`.
    """

    name: ClassVar[str]
    capabilities: ClassVar[BackendCapabilities]
    # Plans kept per instance: one for new tokens and one per context chunk of a
    # batch; older ones are dropped first.
    max_cached_plans: ClassVar[int] = 256

    # ---- declaration ---------------------------------------------------
    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        """Why the backend's libraries cannot be used here (empty when they can)."""
        return list(_import_failures(cls.capabilities.requires))

    @classmethod
    def is_available(cls) -> bool:
        return not cls.unavailable_reasons()

    @classmethod
    def validate_configuration(
        cls, device_capability: DeviceCapability, selector_config: MLAPrefillSelectorConfig
    ) -> list[str]:
        """Human-readable reasons this backend cannot serve the configuration; empty if it can."""
        return cls.capabilities.reasons(device_capability, selector_config)

    # ---- instance --------------------------------------------------------
    def __init__(
        self, *, num_heads: int, scale: float, dims: MLADimensions, device: torch.device | str = "cpu"
    ) -> None:
        if num_heads <= 0:
            raise ValueError(f"num_heads must be positive, got {num_heads}")
        if not scale > 0:
            raise ValueError(f"softmax scale must be positive, got {scale}")
        self.num_heads = num_heads
        self.scale = float(scale)
        self.dims = dims
        self.device = torch.device(device)
        self._plans: OrderedDict[tuple[int, int, bool], RaggedPlan] = OrderedDict()
        self.num_plans_built = 0

    def plan(
        self,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor | None = None,
        *,
        causal: bool,
    ) -> RaggedPlan:
        """Plan one ragged attention shape for the batch (one host sync).

        Later ``run_*`` calls with these same ``cu_seqlens`` tensor objects reuse
        the plan; calls with tensors that were never planned plan them on the spot.
        """
        cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
        seqlens_q = _host_lengths("cu_seqlens_q", cu_seqlens_q)
        seqlens_k = _host_lengths("cu_seqlens_k", cu_k)
        if len(seqlens_q) != len(seqlens_k):
            raise ValueError(
                f"cu_seqlens_q describes {len(seqlens_q)} sequences but cu_seqlens_k {len(seqlens_k)}"
            )
        plan = RaggedPlan(cu_seqlens_q, cu_k, seqlens_q, seqlens_k, causal)
        plan = replace(plan, state=self._build_state(plan))
        key = (id(cu_seqlens_q), id(cu_k), causal)
        self._plans[key] = plan  # the plan holds both tensors, so their ids stay unique
        self._plans.move_to_end(key)
        while len(self._plans) > self.max_cached_plans:
            self._plans.popitem(last=False)
        self.num_plans_built += 1
        return plan

    def clear_plans(self) -> None:
        """Drop every cached plan (and the kernel state it holds)."""
        self._plans.clear()

    def run_prefill_new_tokens(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        return_softmax_lse: bool = False,
        *,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_k: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of the new tokens ``q [T,H,Dqk]`` over ``k [S,H,Dqk]``, ``v [S,H,Dv]``.

        Keys default to the queries' own sequences (``cu_seqlens_k = cu_seqlens``).
        Pass ``cu_seqlens_k`` for keys that extend before the queries (a query
        slice of a longer causal block); the mask is then bottom-right aligned.
        Returns ``o [T,H,Dv]`` and, if asked, ``lse [H,T]`` float32.
        """
        plan = self._plan_for(cu_seqlens, cu_seqlens_k, True, max_seqlen, max_seqlen_k)
        out, lse = self._checked_forward(q, k, v, plan, return_softmax_lse)
        return (out, lse) if return_softmax_lse else out

    def run_prefill_context_chunk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-causal attention of ``q`` over one chunk of cached context; always returns LSE."""
        plan = self._plan_for(cu_seqlens_q, cu_seqlens_k, False, max_seqlen_q, max_seqlen_k)
        return self._checked_forward(q, k, v, plan, True)

    # ---- subclass hooks ----------------------------------------------------
    def _build_state(self, plan: RaggedPlan) -> Any:
        """Per-plan kernel state (planned wrappers, workspaces); none by default."""
        return None

    @abstractmethod
    def _forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RaggedPlan, return_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the kernel on validated inputs; return ``(o [T,H,Dv], lse [H,T] | None)``.

        Rows that see no key need not be right: the caller rewrites them."""

    # ---- internals ---------------------------------------------------------
    def _plan_for(
        self,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor | None,
        causal: bool,
        max_q: int,
        max_k: int | None,
    ) -> RaggedPlan:
        key = (id(cu_q), id(cu_q if cu_k is None else cu_k), causal)
        plan = self._plans.get(key)
        if plan is None:
            plan = self.plan(cu_q, cu_k, causal=causal)
        if max_q < plan.max_seqlen_q:
            raise ValueError(f"max_seqlen_q={max_q} is smaller than the longest query sequence {plan.max_seqlen_q}")
        if max_k is not None and max_k < plan.max_seqlen_k:
            raise ValueError(f"max_seqlen_k={max_k} is smaller than the longest key sequence {plan.max_seqlen_k}")
        return plan

    def _checked_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RaggedPlan, return_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._check_inputs(q, k, v, plan)
        out, lse = self._forward(q, k, v, plan, return_lse)
        neutralize_blind_rows(out, lse, plan)
        assert out.shape == (q.shape[0], self.num_heads, self.dims.v_head_dim), out.shape
        assert lse is None or (lse.shape == (self.num_heads, q.shape[0]) and lse.dtype == torch.float32)
        return out, lse

    def _check_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RaggedPlan) -> None:
        expected = {
            "q": (plan.num_q_tokens, self.num_heads, self.dims.qk_head_dim),
            "k": (plan.num_k_tokens, self.num_heads, self.dims.qk_head_dim),
            "v": (plan.num_k_tokens, self.num_heads, self.dims.v_head_dim),
        }
        for name, tensor in (("q", q), ("k", k), ("v", v)):
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(
                    f"{self.name}: {name} has shape {tuple(tensor.shape)}, expected {expected[name]} "
                    "[tokens, heads, head_dim] from cu_seqlens and the backend's heads/dims"
                )
            if tensor.dtype not in self.capabilities.dtypes:
                raise TypeError(f"{self.name}: {name} has dtype {tensor.dtype}; supported: {self.capabilities.dtypes}")
            if tensor.device.type != self.device.type:
                raise ValueError(f"{self.name}: {name} is on {tensor.device}, backend runs on {self.device}")
        if not q.dtype == k.dtype == v.dtype:
            raise TypeError(f"{self.name}: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")


def neutralize_blind_rows(out_THD: torch.Tensor, lse_HT: torch.Tensor | None, plan: RaggedPlan) -> None:
    """Write the contract's ``o = 0``, ``lse = -inf`` into rows that see no key.

    Kernel libraries disagree there (FA2 returns +inf LSE, others garbage);
    the rows are known on the host from the plan, so this costs no sync.
    Applied to every backend's result by :meth:`MLAPrefillBackend._checked_forward`.
    """
    for rows in plan.blind_query_rows:
        out_THD[rows] = 0
        if lse_HT is not None:
            lse_HT[:, rows] = float("-inf")


def _host_lengths(name: str, cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must be a 1-D tensor [num_seqs + 1] of offsets, got {cu_seqlens!r}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (the kernels' index type), got {cu_seqlens.dtype}")
    offsets = cu_seqlens.tolist()
    lengths = tuple(b - a for a, b in zip(offsets, offsets[1:]))
    if offsets[0] != 0 or any(n < 0 for n in lengths):
        raise ValueError(f"{name} must start at 0 and never decrease, got {offsets}")
    return lengths
