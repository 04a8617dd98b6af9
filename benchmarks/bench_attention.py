"""Attention backends and merge_attn_states on one GPU: our layer against the raw kernels.

For every backend that can run here, TF/s of causal new-token prefill and of a
non-causal context chunk (q and k both S long), through our backend layer and
through the same kernel called directly, in alternating rounds of the same run
(medians); torch's public SDPA
(no LSE) beside them. FLOPs: causal ``H * S^2 * (d_qk + d_v)``, non-causal twice
that. Then merge_attn_states GB/s (Triton vs torch) at 128 heads x T tokens x 128
(bytes: three [T, H, D] bf16 tensors and three [H, T] float32 LSEs).

    python benchmarks/bench_attention.py --out benchmarks/results/attention.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from datetime import datetime, timezone
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from attention.backends.base import DEEPSEEK_MLA_DIMS, DeviceCapability, MLAPrefillSelectorConfig
from attention.backends.registry import MLAPrefillBackendEnum
from attention.backends.selector import backend_reasons
from attention.merge import merge_attn_states

DIMS = DEEPSEEK_MLA_DIMS
SCALE = DIMS.qk_head_dim**-0.5


def versions() -> dict:
    found = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name(0)}  # fmt: skip
    for name in ("flashinfer-python", "triton", "flash-attn-4", "nvidia-cutlass-dsl"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def direct_kernel(name: str, q, k, v, cu, seqlen: int, causal: bool):
    """The same kernel our backend uses, called the way its library documents."""
    if name == "FLASHINFER":
        import flashinfer

        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="auto")
        wrapper.plan(cu.cpu(), cu.cpu(), q.shape[1], q.shape[1], DIMS.qk_head_dim, head_dim_vo=DIMS.v_head_dim,
                     causal=causal, sm_scale=SCALE, q_data_type=q.dtype, kv_data_type=q.dtype)  # fmt: skip
        return lambda: wrapper.run(q, k, v, return_lse=True)
    if name == "FLASH_ATTN":
        from attention.backends.flash_attn import MODULES, default_versions, _importable

        version = next(v for v in default_versions(torch.cuda.get_device_capability()[0]) if _importable(v))
        varlen = __import__(MODULES[version], fromlist=["_"]).flash_attn_varlen_func
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seqlen, max_seqlen_k=seqlen, softmax_scale=SCALE, causal=causal)
        if version == 4:
            return lambda: varlen(q, k, v, return_lse=True, **kwargs)
        return lambda: varlen(q, k, v, return_attn_probs=True, **kwargs)
    if name == "TORCH_SDPA":
        from attention.backends.torch_sdpa import _cudnn_attention

        return lambda: _cudnn_attention(q, k, v, causal, SCALE)
    raise ValueError(name)


def public_sdpa(q, k, v, causal: bool):
    qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, scale=SCALE)


def time_ms(fn, budget_ms: float) -> float:
    return do_bench(fn, warmup=max(25, budget_ms / 4), rep=budget_ms, return_mode="median")


def interleaved(a, b, budget_ms: float, rounds: int) -> tuple[float, float]:
    """Median times of ``a`` and ``b`` over alternating rounds (a, b, b, a, ...), so clock drift hits both."""
    times_a, times_b = [], []
    for i in range(rounds):
        order = [(a, times_a), (b, times_b)] if i % 2 == 0 else [(b, times_b), (a, times_a)]
        for fn, times in order:
            times.append(time_ms(fn, budget_ms))
    return statistics.median(times_a), statistics.median(times_b)


def bench_attention(backends, heads_list, seqlens, budget_ms, rounds) -> list[dict]:
    rows = []
    for heads in heads_list:
        for seqlen in seqlens:
            q = torch.randn(seqlen, heads, DIMS.qk_head_dim, dtype=torch.bfloat16, device="cuda")
            k = torch.randn_like(q)
            v = torch.randn(seqlen, heads, DIMS.v_head_dim, dtype=torch.bfloat16, device="cuda")
            cu = torch.tensor([0, seqlen], dtype=torch.int32, device="cuda")
            for causal in (True, False):
                flops = heads * seqlen**2 * (DIMS.qk_head_dim + DIMS.v_head_dim) * (1 if causal else 2)
                tfs = lambda ms: round(flops / ms / 1e9, 1)  # noqa: E731
                public_ms = time_ms(public_sdpa(q, k, v, causal), budget_ms)
                for name, cls in backends:
                    backend = cls(num_heads=heads, scale=SCALE, dims=DIMS, device="cuda")
                    if causal:
                        ours = partial(backend.run_prefill_new_tokens, q, k, v, cu, seqlen, return_softmax_lse=True)
                    else:
                        ours = partial(backend.run_prefill_context_chunk, q, k, v, cu, cu, seqlen, seqlen)
                    ours()  # plans (and JIT-compiles) outside the timing
                    direct = direct_kernel(name, q, k, v, cu, seqlen, causal)
                    direct_ms, ours_ms = interleaved(direct, ours, budget_ms, rounds)
                    row = {
                        "backend": name, "mode": "causal new tokens" if causal else "non-causal context chunk",
                        "heads": heads, "tokens": seqlen, "ours_ms": round(ours_ms, 3), "direct_ms": round(direct_ms, 3),
                        "ours_tflops": tfs(ours_ms), "direct_tflops": tfs(direct_ms),
                        "ours_vs_direct": round(direct_ms / ours_ms, 4), "torch_sdpa_public_tflops": tfs(public_ms),
                    }  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def bench_merge(tokens_list, heads=128, dim=128, budget_ms=200) -> list[dict]:
    rows = []
    for tokens in tokens_list:
        p, s = (torch.randn(tokens, heads, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        pl, sl = (torch.randn(heads, tokens, device="cuda") for _ in range(2))
        out, out_lse = torch.empty_like(p), torch.empty_like(pl)
        nbytes = 3 * p.numel() * p.element_size() + 3 * pl.numel() * 4
        for impl in ("triton", "torch"):
            ms = time_ms(lambda: merge_attn_states(out, p, pl, s, sl, out_lse, impl=impl), budget_ms)
            row = {"impl": impl, "heads": heads, "tokens": tokens, "head_dim": dim, "ms": round(ms, 4),
                   "effective_GBps": round(nbytes / ms / 1e6, 1)}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--merge-tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--budget-ms", type=float, default=200.0, help="timing budget per measurement")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds of ours vs the direct call")
    parser.add_argument("--backends", nargs="+", default=["FLASHINFER", "FLASH_ATTN", "TORCH_SDPA"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    device = DeviceCapability.of("cuda")
    config = MLAPrefillSelectorConfig(torch.bfloat16, DIMS)
    backends, skipped = [], {}
    for member in map(MLAPrefillBackendEnum.parse, args.backends):
        cls, reasons = backend_reasons(member, device, config)
        if reasons:
            skipped[member.name] = reasons
        else:
            backends.append((member.name, cls))
    result = {
        "benchmark": "MLA prefill attention (qk 192 / v 128, bf16) and merge_attn_states",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": versions(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "backends_not_run": skipped,
        "attention": bench_attention(backends, args.heads, args.tokens, args.budget_ms, args.rounds),
        "merge": bench_merge(args.merge_tokens),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
