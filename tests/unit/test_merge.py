"""merge_attn_states: the torch code and the Triton kernel behind the same tests.

Without a GPU the Triton kernel runs in Triton's interpreter (conftest sets
TRITON_INTERPRET=1); on the GPU machine the ``cuda`` cases run it for real.
"""

import importlib.util

import pytest
import torch
from attn_reference import attention_ref

from attention.merge import merge_attn_states, merge_attn_states_many

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()

# (impl, device) cases this host can run: the interpreter on CPU-only hosts, real kernels on GPU hosts
IMPLS = [pytest.param("torch", "cpu", id="torch-cpu")]
if HAS_CUDA:
    IMPLS += [pytest.param(impl, "cuda", id=f"{impl}-cuda", marks=pytest.mark.gpu) for impl in ("torch", "triton")]
elif HAS_TRITON:
    IMPLS += [pytest.param("triton", "cpu", id="triton-interpreter")]

INF = float("inf")


def _partials(n, tokens=37, heads=3, dim=20, dtype=torch.float32, device="cpu"):
    outs = torch.randn(n, tokens, heads, dim, dtype=dtype, device=device)
    lses = torch.randn(n, heads, tokens, device=device) * 3
    return outs, lses


def _merge2(impl, po, pl, so, sl, out_dtype=None):
    out = torch.empty(po.shape, dtype=out_dtype or po.dtype, device=po.device)
    lse = torch.empty(pl.shape, device=pl.device)
    merge_attn_states(out, po, pl, so, sl, lse, impl=impl)
    return out, lse


@pytest.mark.parametrize("impl,device", IMPLS)
def test_equals_attention_over_concatenated_keys(impl, device):
    heads, dqk, dv = 4, 24, 16
    q = torch.randn(29, heads, dqk, dtype=torch.float64)
    k = torch.randn(50, heads, dqk, dtype=torch.float64)
    v = torch.randn(50, heads, dv, dtype=torch.float64)
    ref = lambda kk, vv: attention_ref(q, kk, vv, [29], [kk.shape[0]], scale=0.2, causal=False)  # noqa: E731
    o_all, lse_all = ref(k, v)
    o_a, lse_a = ref(k[:13], v[:13])
    o_b, lse_b = ref(k[13:], v[13:])
    as_dev = lambda x, dt=torch.float32: x.to(dt).to(device)  # noqa: E731
    out, lse = _merge2(impl, as_dev(o_a), as_dev(lse_a), as_dev(o_b), as_dev(lse_b))
    torch.testing.assert_close(out.cpu().double(), o_all, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu().double(), lse_all, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl,device", IMPLS)
def test_commutative_and_associative(impl, device):
    (a, b, c), (la, lb, lc) = _partials(3, device=device)
    ab, lab = _merge2(impl, a, la, b, lb)
    ba, lba = _merge2(impl, b, lb, a, la)
    torch.testing.assert_close(ab, ba, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lab, lba, atol=1e-6, rtol=1e-6)
    left, l_left = _merge2(impl, ab, lab, c, lc)
    bc, lbc = _merge2(impl, b, lb, c, lc)
    right, l_right = _merge2(impl, a, la, bc, lbc)
    torch.testing.assert_close(left, right, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l_left, l_right, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl,device", IMPLS)
def test_infinities_and_empty_partials(impl, device):
    (p, s), (pl, sl) = _partials(2, tokens=6, heads=2, device=device)
    pl[0, 0], sl[0, 0] = -INF, -INF  # both empty -> zeros, -inf
    pl[0, 1], sl[0, 1] = INF, -INF  # +inf means empty too
    pl[0, 2] = -INF  # only suffix
    sl[0, 3] = INF  # only prefix (+inf suffix)
    pl[1, 4], sl[1, 4] = float("nan"), 0.5  # NaN LSE means empty
    p[0, 0] = p[2, 0] = float("nan")  # garbage in an empty partial must not leak
    s[0, 0] = float("nan")
    out, lse = _merge2(impl, p, pl, s, sl)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.all(out[0, 0] == 0) and lse[0, 0] == -INF
    assert torch.all(out[1, 0] == 0) and lse[0, 1] == -INF
    torch.testing.assert_close(out[2, 0], s[2, 0])
    torch.testing.assert_close(lse[0, 2], sl[0, 2])
    torch.testing.assert_close(out[3, 0], p[3, 0])
    torch.testing.assert_close(lse[0, 3], pl[0, 3])
    torch.testing.assert_close(out[4, 1], s[4, 1])
    torch.testing.assert_close(lse[1, 4], sl[1, 4])


@pytest.mark.parametrize("impl,device", IMPLS)
def test_n_way_equals_repeated_two_way(impl, device):
    outs, lses = _partials(5, device=device)
    lses[2, 0, :7] = -INF
    lses[:, 1, 3] = -INF  # a query with no keys anywhere
    acc, acc_lse = outs[0], lses[0]
    for o, lse in zip(outs[1:], lses[1:]):
        acc, acc_lse = _merge2(impl, acc, acc_lse, o, lse)
    out, lse = merge_attn_states_many(outputs=outs, lses=lses, impl=impl)
    torch.testing.assert_close(out, acc, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, acc_lse, atol=1e-5, rtol=1e-5)
    assert torch.all(out[3, 1] == 0) and lse[1, 3] == -INF
    one, one_lse = merge_attn_states_many(outputs=outs[:1], lses=lses[:1], impl=impl)
    expected = outs[0].clone()
    expected[3, 1] = 0  # that query has no keys
    torch.testing.assert_close(one, expected)
    torch.testing.assert_close(one_lse, lses[0])


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_outputs_merge_in_fp32(impl, device, dtype):
    outs, lses = _partials(2, dtype=dtype, device=device)
    out, lse = _merge2(impl, outs[0], lses[0], outs[1], lses[1])
    ref, ref_lse = _merge2("torch", outs[0].float(), lses[0], outs[1].float(), lses[1])
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref.to(dtype))  # exactly one rounding, at the end
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl,device", IMPLS)
def test_strided_lse_views_and_in_place_output(impl, device):
    (p, s), (pl, sl) = _partials(2, tokens=33, heads=4, device=device)
    expected, expected_lse = _merge2("torch", p, pl, s, sl)
    # LSEs as [H, T] views of [T, H] storage (FlashInfer's layout), output written over the suffix
    pl_view, sl_view = pl.t().contiguous().t(), sl.t().contiguous().t()
    assert pl_view.stride() == (1, 4)
    merge_attn_states(s, p, pl_view, s, sl_view, sl_view, impl=impl)
    torch.testing.assert_close(s, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sl_view, expected_lse, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl,device", IMPLS)
def test_token_slices_of_larger_buffers(impl, device):
    # the MLA layer merges into attn[tokens] / lse[:, tokens] views
    (p, s), (pl, sl) = _partials(2, tokens=40, heads=2, device=device)
    out, lse = p.clone(), pl.clone()
    merge_attn_states(out[5:30], s[5:30], sl[:, 5:30], out[5:30], lse[:, 5:30], lse[:, 5:30], impl=impl)
    ref, ref_lse = _merge2("torch", s[5:30], sl[:, 5:30], p[5:30], pl[:, 5:30])
    torch.testing.assert_close(out[5:30], ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse[:, 5:30], ref_lse, atol=1e-6, rtol=1e-6)
    assert torch.equal(out[:5], p[:5]) and torch.equal(out[30:], p[30:])
    assert torch.equal(lse[:, :5], pl[:, :5])


def test_bad_arguments_are_named():
    (p, s), (pl, sl) = _partials(2, tokens=8, heads=2)
    out = torch.empty_like(p)
    with pytest.raises(TypeError, match="prefix_lse must be float32"):
        merge_attn_states(out, p, pl.bfloat16(), s, sl)
    with pytest.raises(ValueError, match=r"suffix_lse must be \[H, T\] = \(2, 8\), got \(8, 2\)"):
        merge_attn_states(out, p, pl, s, sl.t())
    with pytest.raises(ValueError, match="partial outputs must all be"):
        merge_attn_states(out, p, pl, s[:4], sl)
    with pytest.raises(ValueError, match="impl must be one of"):
        merge_attn_states(out, p, pl, s, sl, impl="cuda")
    with pytest.raises(ValueError, match=r"lses must be \[N, H, T\]"):
        merge_attn_states_many(torch.stack([p, s]), torch.stack([pl]))
    with pytest.raises(TypeError, match="lses must be float32"):
        merge_attn_states_many(torch.stack([p, s]), torch.stack([pl, sl]).half())


@pytest.mark.parametrize("impl,device", IMPLS)
def test_many_into_one_of_its_inputs(impl, device):
    outs, lses = _partials(3, device=device)
    expected, expected_lse = merge_attn_states_many(outs.clone(), lses.clone(), impl="torch")
    merge_attn_states_many(outs, lses, output=outs[0], output_lse=lses[0], impl=impl)
    torch.testing.assert_close(outs[0], expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lses[0], expected_lse, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="the race needs the real kernel at scale")
def test_in_place_merge_of_flashinfer_lse_at_deepseek_scale():
    """The MLA layer's in-place merge with FlashInfer's LSE layout, at 8K tokens x 128 heads: before the
    merged LSE went to a temporary, 9 of 10 runs weighted some token's output with a half-written LSE."""
    tokens, heads, dim = 8192, 128, 128
    for _ in range(10):
        p, s = (torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        pl, sl = ((torch.randn(tokens, heads, device="cuda") * 3).t() * 1.0 for _ in range(2))  # [H, T] of [T, H]
        assert sl.stride() == (1, heads)
        expected, expected_lse = _merge2("torch", p, pl, s, sl)
        merge_attn_states(s, p, pl, s, sl, output_lse=sl, impl="triton")
        torch.testing.assert_close(s, expected, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(sl, expected_lse, atol=1e-5, rtol=1e-5)
