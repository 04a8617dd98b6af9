"""Every MLA prefill backend that can run here, against an fp64 reference attention.

Tolerance in the flash-attention style: the backend's error against the
float64 oracle must be at most twice the error of a plain implementation in
the same dtype, plus the rounding of the result to that dtype. On the GPU
machine the same tests cover the CUDA backends (marked ``gpu``).
"""

import pytest
import torch
from attn_reference import attention_ref, max_err, rounding_error

from attention.backends.base import (
    DEEPSEEK_MLA_DIMS,
    DeviceCapability,
    MLADimensions,
    MLAPrefillSelectorConfig,
)
from attention.backends.registry import MLAPrefillBackendEnum
from attention.backends.selector import backend_reasons

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cases(dtypes=DTYPES, dims=DEEPSEEK_MLA_DIMS):
    """(backend, device, dtype) triples whose backend validates on that device for those dims."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    cases = []
    for device in devices:
        cap = DeviceCapability.of(device)
        for member in MLAPrefillBackendEnum:
            if member is MLAPrefillBackendEnum.CUSTOM:
                continue
            for dtype in dtypes:
                _, reasons = backend_reasons(member, cap, MLAPrefillSelectorConfig(dtype, dims))
                if not reasons:
                    marks = [pytest.mark.gpu] if device == "cuda" else []
                    name = f"{member.name}-{device}-{str(dtype).removeprefix('torch.')}"
                    cases.append(pytest.param(member, device, dtype, id=name, marks=marks))
    return cases


CASES = _cases()
OTHER_DIMS = MLADimensions(qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24)


def test_torch_sdpa_runs_on_cpu_in_every_dtype():
    cpu_cases = [p.values for p in CASES if p.values[1] == "cpu"]
    assert cpu_cases == [(MLAPrefillBackendEnum.TORCH_SDPA, "cpu", dtype) for dtype in DTYPES]


def _make(member, device, heads, dims=DEEPSEEK_MLA_DIMS):
    cls = member.get_class()
    return cls(num_heads=heads, scale=dims.qk_head_dim**-0.5, dims=dims, device=device)


def _inputs(seqlens_q, seqlens_k, heads, dtype, device, dims=DEEPSEEK_MLA_DIMS):
    tq, tk = sum(seqlens_q), sum(seqlens_k)
    q = torch.randn(tq, heads, dims.qk_head_dim, dtype=dtype, device=device)
    k = torch.randn(tk, heads, dims.qk_head_dim, dtype=dtype, device=device)
    v = torch.randn(tk, heads, dims.v_head_dim, dtype=dtype, device=device)
    cu_q = torch.tensor([0] + list(torch.tensor(seqlens_q).cumsum(0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(seqlens_k).cumsum(0)), dtype=torch.int32, device=device)
    return q, k, v, cu_q, cu_k


def _check_against_reference(out, lse, q, k, v, seqlens_q, seqlens_k, scale, causal, dtype):
    args = (q.cpu(), k.cpu(), v.cpu(), seqlens_q, seqlens_k)
    out_ref, lse_ref = attention_ref(*args, scale=scale, causal=causal)
    out_pt, lse_pt = attention_ref(*args, scale=scale, causal=causal, dtype=dtype)
    out, lse = out.cpu(), lse.cpu()
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any()
    out_tol = 2 * max_err(out_pt, out_ref) + 2 * rounding_error(out_ref, dtype) + 1e-6
    lse_tol = 2 * max_err(lse_pt, lse_ref) + 2 * rounding_error(lse_ref, dtype) + 1e-5
    assert max_err(out, out_ref) <= out_tol, (max_err(out, out_ref), out_tol)
    assert max_err(lse, lse_ref) <= lse_tol, (max_err(lse, lse_ref), lse_tol)
    # rows that see no key: exactly zero output and -inf LSE
    empty = torch.isinf(lse_ref)
    assert torch.all(lse[empty] == float("-inf"))
    assert torch.all(out.transpose(0, 1)[empty] == 0)


@pytest.mark.parametrize("member,device,dtype", CASES)
def test_new_tokens_ragged_odd_lengths(member, device, dtype):
    seqlens = [1, 113, 1023, 4096]
    heads = 2
    backend = _make(member, device, heads)
    q, k, v, cu, _ = _inputs(seqlens, seqlens, heads, dtype, device)
    out, lse = backend.run_prefill_new_tokens(q, k, v, cu, max(seqlens), return_softmax_lse=True)
    _check_against_reference(out, lse, q, k, v, seqlens, seqlens, backend.scale, True, dtype)
    assert torch.equal(backend.run_prefill_new_tokens(q, k, v, cu, max(seqlens)), out)


@pytest.mark.parametrize("member,device,dtype", CASES)
def test_new_tokens_bottom_right_causal_q_len_ne_kv_len(member, device, dtype):
    # q shorter than k (a query slice at the end of a causal block), equal, and
    # q longer than k: its first q_len - kv_len queries see nothing.
    seqlens_q, seqlens_k = [113, 1, 40, 7, 64], [203, 1, 40, 3, 1023]
    heads = 3
    backend = _make(member, device, heads)
    q, k, v, cu_q, cu_k = _inputs(seqlens_q, seqlens_k, heads, dtype, device)
    out, lse = backend.run_prefill_new_tokens(
        q, k, v, cu_q, max(seqlens_q), True, cu_seqlens_k=cu_k, max_seqlen_k=max(seqlens_k)
    )
    _check_against_reference(out, lse, q, k, v, seqlens_q, seqlens_k, backend.scale, True, dtype)


@pytest.mark.parametrize("member,device,dtype", CASES)
def test_context_chunk_non_causal(member, device, dtype):
    # includes a sequence with no keys in this chunk and one with no queries
    seqlens_q, seqlens_k = [113, 5, 1, 0, 64], [1023, 0, 203, 7, 1]
    heads = 2
    backend = _make(member, device, heads)
    q, k, v, cu_q, cu_k = _inputs(seqlens_q, seqlens_k, heads, dtype, device)
    out, lse = backend.run_prefill_context_chunk(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k))
    _check_against_reference(out, lse, q, k, v, seqlens_q, seqlens_k, backend.scale, False, dtype)


@pytest.mark.parametrize("member,device,dtype", [p for p in CASES if p.values[1] == "cuda" and p.values[2] == torch.bfloat16])
@pytest.mark.parametrize(
    "seqlens_q,seqlens_k,causal",
    [([8192], [16384], False), ([4096, 4096], [8192, 16384], False), ([8192], [8192], True)],
    ids=["context-8Kx16K", "context-ragged", "causal-8K"],
)
def test_deepseek_sized_chunks_on_gpu(member, device, dtype, seqlens_q, seqlens_k, causal):
    """The shapes of 8K-token chunks over 16K-row context pieces at 128 heads, against float32 attention of
    the same bf16 inputs (small shapes miss kernel paths -- split KV, many tiles -- that these take)."""
    heads = 128
    backend = _make(member, device, heads)
    q, k, v, cu_q, cu_k = _inputs(seqlens_q, seqlens_k, heads, dtype, device)
    if causal:
        out, lse = backend.run_prefill_new_tokens(q, k, v, cu_q, max(seqlens_q), True)
    else:
        out, lse = backend.run_prefill_context_chunk(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k))
    for group in range(0, heads, 16):  # the float32 reference, 16 heads at a time to bound its memory
        h = slice(group, group + 16)
        out_ref, lse_ref = attention_ref(
            q[:, h].float(), k[:, h].float(), v[:, h].float(), seqlens_q, seqlens_k, scale=backend.scale,
            causal=causal, dtype=torch.float32,
        )  # fmt: skip
        assert max_err(out[:, h].float(), out_ref) <= 4 * rounding_error(out_ref, dtype) + 1e-3
        assert max_err(lse[h], lse_ref) <= 1e-2


@pytest.mark.parametrize("member,device,dtype", _cases([torch.float32, torch.bfloat16], OTHER_DIMS))
def test_other_mla_dims(member, device, dtype):
    seqlens = [5, 17]
    backend = _make(member, device, 4, OTHER_DIMS)
    q, k, v, cu, _ = _inputs(seqlens, seqlens, 4, dtype, device, OTHER_DIMS)
    out, lse = backend.run_prefill_new_tokens(q, k, v, cu, 17, True)
    _check_against_reference(out, lse, q, k, v, seqlens, seqlens, backend.scale, True, dtype)


@pytest.mark.parametrize("member,device,dtype", [p for p in CASES if p.values[2] == torch.bfloat16])
def test_strided_v_view(member, device, dtype):
    # V is a slice of the kv_b_proj output, as in the MLA layer: not contiguous
    seqlens = [9, 30]
    heads, dims = 2, DEEPSEEK_MLA_DIMS
    backend = _make(member, device, heads)
    q, k, _, cu, _ = _inputs(seqlens, seqlens, heads, dtype, device)
    kv = torch.randn(sum(seqlens), heads, dims.qk_nope_head_dim + dims.v_head_dim, dtype=dtype, device=device)
    v = kv[..., dims.qk_nope_head_dim :]
    out, lse = backend.run_prefill_new_tokens(q, k, v, cu, 30, True)
    out_c, lse_c = backend.run_prefill_new_tokens(q, k, v.contiguous(), cu, 30, True)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)


def test_plan_once_per_batch_reused_across_layers():
    member = MLAPrefillBackendEnum.TORCH_SDPA
    backend = _make(member, "cpu", 2)
    q, k, v, cu, _ = _inputs([4, 6], [4, 6], 2, torch.float32, "cpu")
    backend.plan(cu, causal=True)
    for _layer in range(3):
        backend.run_prefill_new_tokens(q, k, v, cu, 6)
    assert backend.num_plans_built == 1
    # an unplanned cu_seqlens tensor is planned on first use, then reused
    cu2 = cu.clone()
    backend.run_prefill_new_tokens(q, k, v, cu2, 6)
    backend.run_prefill_new_tokens(q, k, v, cu2, 6)
    assert backend.num_plans_built == 2


def test_bad_inputs_name_the_problem():
    backend = _make(MLAPrefillBackendEnum.TORCH_SDPA, "cpu", 2)
    q, k, v, cu, _ = _inputs([4, 6], [4, 6], 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"q has shape \(10, 2, 100\)"):
        backend.run_prefill_new_tokens(q[..., :100], k, v, cu, 6)
    with pytest.raises(ValueError, match=r"v has shape"):
        backend.run_prefill_new_tokens(q, k, v[:9], cu, 6)
    with pytest.raises(TypeError, match="int32"):
        backend.run_prefill_new_tokens(q, k, v, cu.long(), 6)
    with pytest.raises(ValueError, match="never decrease"):
        backend.run_prefill_new_tokens(q, k, v, torch.tensor([0, 6, 4], dtype=torch.int32), 6)
    with pytest.raises(ValueError, match="max_seqlen_q=5 is smaller than the longest query sequence 6"):
        backend.run_prefill_new_tokens(q, k, v, cu, 5)
    with pytest.raises(TypeError, match="dtypes differ"):
        backend.run_prefill_new_tokens(q, k.to(torch.bfloat16), v, cu, 6)
    with pytest.raises(ValueError, match="num_heads must be positive"):
        type(backend)(num_heads=0, scale=1.0, dims=DEEPSEEK_MLA_DIMS)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("member,device,dtype", CASES)
def test_single_sequence(member, device, dtype, causal):
    # backends may take a shortcut for a batch of one sequence (TORCH_SDPA on CUDA does)
    heads = 2
    backend = _make(member, device, heads)
    q, k, v, cu, _ = _inputs([777], [777], heads, dtype, device)
    if causal:
        out, lse = backend.run_prefill_new_tokens(q, k, v, cu, 777, return_softmax_lse=True)
    else:
        out, lse = backend.run_prefill_context_chunk(q, k, v, cu, cu, 777, 777)
    _check_against_reference(out, lse, q, k, v, [777], [777], backend.scale, causal, dtype)
