"""Independent attention references for tests (no project code).

``attention_ref`` computes per-sequence attention from scratch. With
``dtype=torch.float64`` it is the oracle; with a low-precision ``dtype`` it
plays "a plain PyTorch implementation in that dtype": each op runs in float32
and its result is rounded to ``dtype`` -- what a bf16/fp16 GEMM with float32
accumulation does on a GPU (the CPU's native bf16 GEMM is far too slow here).
"""

import torch


def _round(x, dtype):
    return x.to(dtype).to(torch.float32) if dtype != torch.float64 else x


def attention_ref(q, k, v, seqlens_q, seqlens_k, *, scale, causal, dtype=torch.float64):
    """Return ``out [T, H, Dv]`` (float64/float32) and ``lse [H, T]`` for a ragged batch."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    outs, lses = [], []
    qs = ks = 0
    heads, dv = q.shape[1], v.shape[2]
    for lq, lk in zip(seqlens_q, seqlens_k):
        qi = _round(q[qs : qs + lq].to(work), dtype)
        ki = _round(k[ks : ks + lk].to(work), dtype)
        vi = _round(v[ks : ks + lk].to(work), dtype)
        s = _round(torch.einsum("thd,shd->hts", qi, ki) * scale, dtype)
        if causal:
            i = torch.arange(lq, device=q.device)[:, None]
            j = torch.arange(lk, device=q.device)[None, :]
            s = s.masked_fill(j > i + (lk - lq), float("-inf"))
        if lk == 0:
            lse = torch.full((heads, lq), float("-inf"), dtype=work, device=q.device)
        else:
            lse = _round(torch.logsumexp(s, dim=-1), dtype)
        p = _round(torch.exp(s - torch.where(torch.isinf(lse), 0, lse)[..., None]), dtype)
        o = _round(torch.einsum("hts,shd->thd", p, vi), dtype) if lk else torch.zeros(lq, heads, dv, dtype=work, device=q.device)
        outs.append(o)
        lses.append(lse)
        qs += lq
        ks += lk
    return torch.cat(outs), torch.cat(lses, dim=1)


def rounding_error(ref, dtype):
    """Error of merely storing ``ref`` in ``dtype`` (the "plus rounding" term)."""
    finite = torch.isfinite(ref)
    return (ref[finite].to(dtype).double() - ref[finite].double()).abs().max().item() if finite.any() else 0.0


def max_err(x, ref):
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(x)), "non-finite entries differ from the reference"
    return (x.double()[finite] - ref.double()[finite]).abs().max().item() if finite.any() else 0.0
