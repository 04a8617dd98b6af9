"""How FLASHINFER's chunked-prefill outliers were found: each suspect checked in isolation, on the GPU.

The outliers were a race in our own Triton ``merge_attn_states`` (an output LSE written over an
input LSE that other warps of the program still had to read; see ``attention.merge_triton``),
not in FlashInfer. The modes, in the order they narrowed it down:

``race``: one ragged prefill call at DeepSeek shapes whose V is written by the kernel just before
it, many times, with FlashInfer's programmatic dependent launch (PDL) on and off, counting runs
whose output differs from a run on idle inputs (none did).

``calls``: prefills one prompt through the first ``--layers`` layers of a DeepSeek-V3-shaped model
(random weights, bf16) in chunks of ``--chunk`` tokens and checks every attention call -- the new
tokens' causal call and each cached-context call -- right after it returns, against float32
attention of the same bf16 inputs, and against a rerun of the kernel on an idle GPU (all right).

``bisect``: the same prefill against the float32 model with a device sync before, after or around
every attention call (the outliers stayed).

``record``: no sync anywhere; every call's inputs and output and every merge's inputs and output are
copied on the stream, then checked: calls against float32 attention, merges against the torch merge
of the same inputs, merge inputs against the calls that made them (the Triton merges were wrong).

``merge``: the Triton merge alone, LSE layouts x in place or not (``--unpatched``: as before the fix).

    python benchmarks/probes/probe_flashinfer.py record --out FILE.json
    python benchmarks/probes/probe_flashinfer.py merge --unpatched --out FILE.json
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ (machine.py, timing.py, ...), the repository

import torch

from attention.backends.base import DeviceCapability, MLAPrefillBackend, MLAPrefillSelectorConfig, RaggedPlan
from attention.backends.selector import get_mla_prefill_backend
from attention.mla import MLAAttention
from accuracy_chunked import prefill
from machine import machine
from configs.model import load_model_config
from workers.model import DeepseekPrefillModel
from workers.weights import load_weights


def reference(q, k, v, plan: RaggedPlan, scale: float, heads_per_pass: int = 8):
    """float32 attention of the given (bf16) inputs: ``out [T, H, Dv]``, ``lse [H, T]`` (natural log)."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    qs = ks = 0
    for lq, lk in zip(plan.seqlens_q, plan.seqlens_k):
        for h0 in range(0, q.shape[1], heads_per_pass):
            h = slice(h0, h0 + heads_per_pass)
            qi, ki, vi = (t.float() for t in (q[qs : qs + lq, h], k[ks : ks + lk, h], v[ks : ks + lk, h]))
            s = torch.einsum("thd,shd->hts", qi, ki) * scale
            if plan.causal:
                i = torch.arange(lq, device=q.device)[:, None]
                j = torch.arange(lk, device=q.device)[None, :]
                s.masked_fill_(j > i + (lk - lq), float("-inf"))
            m = torch.logsumexp(s, dim=-1)
            lse[h, qs : qs + lq] = m
            out[qs : qs + lq, h] = torch.einsum("hts,shd->thd", torch.exp(s - m[..., None]), vi)
            del s
        qs += lq
        ks += lk
    return out, lse


def token_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per token: max |out - ref| over heads and dims, relative to the call's largest |ref|."""
    return (out.float() - ref).abs().amax(dim=(1, 2)) / ref.abs().max()


def summarize(errors: torch.Tensor, top: int = 5) -> dict:
    values, where = errors.topk(min(top, errors.numel()))
    median = errors.median().item()
    return {
        "max": round(values[0].item(), 5),
        "median": round(median, 5),
        "tokens_over_4x_median": int((errors > 4 * median).sum()),
        "worst_tokens": where.tolist(),
        "worst_errors": [round(x, 5) for x in values.tolist()],
    }


class CallChecker:
    """Wraps a backend instance's ``_checked_forward`` to check each call right after it returns."""

    def __init__(self, backend: MLAPrefillBackend, other: MLAPrefillBackend | None) -> None:
        self.backend, self.other, self.records = backend, other, []
        self.layer, self.chunk = -1, -1
        self._forward = backend._checked_forward
        backend._checked_forward = self

    def enter(self, layer: int) -> None:
        self.layer = layer
        self.chunk += layer == 0

    def __call__(self, q, k, v, plan, return_lse):
        out, lse = self._forward(q, k, v, plan, return_lse)  # no sync before: the race window stays as it is
        _sync(q.device)
        first = out.clone(), None if lse is None else lse.clone()
        again, _ = self._forward(q, k, v, plan, True)  # same inputs, idle GPU
        ref, ref_lse = reference(q, k, v, plan, self.backend.scale)
        record = {
            "chunk": self.chunk, "layer": self.layer, "call": "causal new tokens" if plan.causal else "cached context",
            "q_tokens": plan.num_q_tokens, "k_tokens": plan.num_k_tokens,
            "error": summarize(token_errors(first[0], ref)),
            "error_rerun": summarize(token_errors(again, ref)),
            "first_vs_rerun_tokens_differing": int((first[0] != again).any(dim=(1, 2)).sum()),
            "first_vs_rerun_max_abs": (first[0].float() - again.float()).abs().max().item(),
        }  # fmt: skip
        if first[1] is not None:
            finite = torch.isfinite(ref_lse)
            record["lse_max_abs_error"] = (first[1] - ref_lse)[finite].abs().max().item()
        if self.other is not None:
            other_out, _ = self.other._checked_forward(q, k, v, plan, True)
            record[f"error_{self.other.name}"] = summarize(token_errors(other_out, ref))
        self.records.append(record)
        print(json.dumps({key: record[key] for key in ("chunk", "layer", "call", "q_tokens", "k_tokens")})
              + f" err {record['error']['max']:.4f} rerun {record['error_rerun']['max']:.4f} "
              f"differing tokens {record['first_vs_rerun_tokens_differing']}", flush=True)  # fmt: skip
        return out, lse


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_calls(args) -> dict:
    device = torch.device(args.device)
    config = load_model_config(args.model, num_hidden_layers=args.layers)
    selector = MLAPrefillSelectorConfig(torch.bfloat16, config.attention.dims)
    backend_cls = get_mla_prefill_backend(selector, DeviceCapability.of(device), args.backend)
    model = DeepseekPrefillModel.create(config, backend_cls, dtype=torch.bfloat16, device=device)
    load_weights(model, None, 0)
    other = None
    if args.compare:
        other_cls = get_mla_prefill_backend(selector, DeviceCapability.of(device), args.compare)
        other = config.attention.create_backend(other_cls, num_heads=model.backend.num_heads, device=device)
    checker = CallChecker(model.backend, other)
    for index, layer in enumerate(m for m in model.modules() if isinstance(m, MLAAttention)):
        layer.register_forward_pre_hook(lambda module, inputs, index=index: checker.enter(index))
    tokens = torch.randint(0, config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)).to(device)
    prefill(model, tokens, args.chunk)
    return {"backend": backend_cls.name, "calls": checker.records}


def _model(args, device):
    config = load_model_config(args.model, num_hidden_layers=args.layers)
    selector = MLAPrefillSelectorConfig(torch.bfloat16, config.attention.dims)
    backend_cls = get_mla_prefill_backend(selector, DeviceCapability.of(device), args.backend)
    model = DeepseekPrefillModel.create(config, backend_cls, dtype=torch.bfloat16, device=device)
    load_weights(model, None, 0)
    tokens = torch.randint(0, config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)).to(device)
    return config, model, tokens


def probe_bisect(args) -> dict:
    """Chunked prefill against the float32 model with a device sync before, after or around every
    attention call (or none): which sync makes the outliers go away."""
    from attention.backends.torch_sdpa import TorchSDPAPrefillBackend

    device = torch.device(args.device)
    config, model, tokens = _model(args, device)
    reference = DeepseekPrefillModel.create(config, TorchSDPAPrefillBackend, dtype=torch.float32, device=device)
    load_weights(reference, None, 0)
    _, ref_latents = prefill(reference, tokens, args.tokens)
    del reference
    forward, runs = model.backend._checked_forward, []
    for sync in args.syncs:
        def wrapped(q, k, v, plan, return_lse, sync=sync):
            if sync in ("before", "both"):
                _sync(device)
            result = forward(q, k, v, plan, return_lse)
            if sync in ("after", "both"):
                _sync(device)
            return result

        model.backend._checked_forward = wrapped
        for repeat in range(args.repeats):
            _, latents = prefill(model, tokens, args.chunk)
            layers = [summarize(token_errors(got.unsqueeze(1), ref.unsqueeze(1))) for got, ref in zip(latents, ref_latents)]
            runs.append({"sync": sync, "repeat": repeat, "latent_per_layer": layers})
            print(sync, repeat, [layer["max"] for layer in layers], layers[-1]["worst_tokens"], flush=True)
    return {"backend": model.backend.name, "chunk": args.chunk, "runs": runs}


def probe_record(args) -> dict:
    """No sync anywhere: every attention call's inputs and output, every merge's inputs and output,
    are copied on the stream as the next kernel sees them, and checked once the prefill is over:
    each call against float32 attention of its inputs, each merge against the torch merge of its
    inputs, and each merge's inputs against the outputs of the calls that made them."""
    from attention import mla
    from attention.merge import merge_attn_states

    device = torch.device(args.device)
    _, model, tokens = _model(args, device)
    backend, calls, merges = model.backend, [], []
    forward = backend._checked_forward
    state = {"layer": -1, "chunk": -1}

    def recording(q, k, v, plan, return_lse):
        out, lse = forward(q, k, v, plan, return_lse)
        calls.append((dict(state), plan, q.clone(), k.clone(), v.clone(), out.clone(), None if lse is None else lse.clone()))
        return out, lse

    def merging(output, prefix, prefix_lse, suffix, suffix_lse, output_lse=None, **kw):
        inputs = [t.clone() for t in (prefix, prefix_lse, suffix, suffix_lse)]
        merge_attn_states(output, prefix, prefix_lse, suffix, suffix_lse, output_lse, **kw)
        merges.append((dict(state), len(calls), inputs, output.clone(), output_lse.clone()))

    backend._checked_forward = recording
    mla.merge_attn_states = merging
    for index, layer in enumerate(m for m in model.modules() if isinstance(m, MLAAttention)):
        def enter(module, inputs, index=index):
            state["layer"] = index
            state["chunk"] += index == 0

        layer.register_forward_pre_hook(enter)
    prefill(model, tokens, args.chunk)
    _sync(device)
    records = []
    for where, plan, q, k, v, out, lse in calls:
        ref, ref_lse = reference(q, k, v, plan, backend.scale)
        record = {**where, "call": "causal new tokens" if plan.causal else "cached context",
                  "q_tokens": plan.num_q_tokens, "k_tokens": plan.num_k_tokens,
                  "error": summarize(token_errors(out, ref))}  # fmt: skip
        if lse is not None:
            record["lse_max_abs_error"] = (lse - ref_lse).abs().max().item()
        records.append(record)
        print(json.dumps({k: record[k] for k in ("chunk", "layer", "call")}), record["error"]["max"], flush=True)
    merge_records, last = [], {}
    for where, ncalls, (prefix, prefix_lse, suffix, suffix_lse), out, out_lse in merges:
        expected, expected_lse = torch.empty_like(out), torch.empty_like(out_lse)
        merge_attn_states(expected, prefix, prefix_lse, suffix, suffix_lse, expected_lse, impl="torch")
        context_call = calls[ncalls - 1]  # the cached-context call whose result is the prefix
        key = (where["chunk"], where["layer"])
        suffix_from = last.get(key) or next(c[5:] for c in calls[:ncalls] if c[0] == where and c[1].causal)
        rows_changed = lambda a, b: (a != b).reshape(a.shape[0], -1).any(dim=1) if a.dim() == 3 else (a != b).any(dim=0)  # noqa: E731
        record = {
            **where,
            "triton_vs_torch_merge": summarize(token_errors(out, expected.float())),
            "prefix_tokens_changed_since_call": int(rows_changed(prefix, context_call[5]).sum()),
            "prefix_lse_tokens_changed_since_call": int(rows_changed(prefix_lse, context_call[6]).sum()),
            "suffix_tokens_changed_since_made": int(rows_changed(suffix, suffix_from[0]).sum()),
            "suffix_lse_tokens_changed_since_made": int(rows_changed(suffix_lse, suffix_from[1]).sum()),
        }
        for name in ("prefix", "suffix"):
            a, b = (prefix, context_call[5]) if name == "prefix" else (suffix, suffix_from[0])
            changed = rows_changed(a, b).nonzero().flatten()
            record[f"{name}_changed_tokens"] = changed[:12].tolist()
        last[key] = (out, out_lse)
        merge_records.append(record)
        print(json.dumps(record), flush=True)
    return {"backend": backend.name, "calls": records, "merges": merge_records}


def probe_merge(args) -> dict:
    """The Triton merge alone at 8K tokens x 128 heads, against the torch merge of the same inputs: LSEs
    in FlashInfer's ``[T, H]`` storage or contiguous ``[H, T]``, output and output LSE over the suffix's
    or not. ``--unpatched`` merges an aliased output LSE in place, as before the fix."""
    import itertools

    from attention import merge_triton
    from attention.merge import merge_attn_states

    if args.unpatched:
        merge_triton._shares_memory = lambda tensor, others: False
    tokens, heads, dim = 8192, 128, 128
    rows = []
    for layout, out_is_suffix, lse_is_suffix in itertools.product(("[T, H] storage", "[H, T]"), (True, False), (True, False)):
        bad = 0
        for _ in range(args.trials):
            p, s = (torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            pl, sl = (torch.randn(tokens, heads, device="cuda") * 3 for _ in range(2))
            pl, sl = (x.t() * 1.0 if layout.startswith("[T") else x.t().contiguous() for x in (pl, sl))
            expected, expected_lse = torch.empty_like(s), torch.empty_like(sl)
            merge_attn_states(expected, p, pl, s, sl, expected_lse, impl="torch")
            out = s if out_is_suffix else torch.empty_like(s)
            out_lse = sl if lse_is_suffix else torch.empty_like(sl)
            merge_attn_states(out, p, pl, s, sl, out_lse, impl="triton")
            bad += bool(((out.float() - expected.float()).abs() > 0.05).any() or ((out_lse - expected_lse).abs() > 1e-3).any())
        rows.append({"lse_layout": layout, "output_is_suffix": out_is_suffix, "output_lse_is_suffix_lse": lse_is_suffix,
                     "trials": args.trials, "trials_with_wrong_tokens": bad})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return {"unpatched": args.unpatched, "runs": rows}


def probe_race(args) -> dict:
    import flashinfer

    device = torch.device("cuda")
    heads, dqk, dv, scale = 128, 192, 128, 192**-0.5
    gen = torch.Generator(device=device).manual_seed(0)
    results = []
    for causal, lq, lk in ((True, 8192, 8192), (False, 8192, 16384)):
        q = torch.randn(lq, heads, dqk, device=device, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(lk, heads, dqk, device=device, dtype=torch.bfloat16, generator=gen)
        kv = torch.randn(lk, heads, 128 + dv, device=device, dtype=torch.bfloat16, generator=gen)  # v is a strided slice
        latent = torch.randn(lk, 512, device=device, dtype=torch.bfloat16, generator=gen) / 512**0.5
        w_v = torch.randn(512, heads * dv, device=device, dtype=torch.bfloat16, generator=gen)
        producers = {
            "copy": lambda kv=kv: kv[..., 128:].contiguous(),  # what the MLA layer's backend call does
            "gemm": lambda latent=latent, w_v=w_v, lk=lk: (latent @ w_v).view(lk, heads, dv),  # an up-projection GEMM writes V
        }
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=device), "NHD")
        wrapper.plan(
            torch.tensor([0, lq], dtype=torch.int32), torch.tensor([0, lk], dtype=torch.int32), heads, heads, dqk,
            head_dim_vo=dv, causal=causal, sm_scale=scale, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
        )  # fmt: skip
        for producer, make_v in producers.items():
            v_idle = make_v()
            torch.cuda.synchronize()
            clean, clean_lse = wrapper.run(q, k, v_idle, return_lse=True)
            torch.cuda.synchronize()
            for pdl in (True, False):
                bad, worst, tokens = 0, 0.0, set()
                for _ in range(args.trials):
                    v = make_v()  # written by the kernel right before the attention kernel
                    out, lse = wrapper.run(q, k, v, return_lse=True, enable_pdl=pdl)
                    del v
                    torch.cuda.synchronize()
                    if not (torch.equal(out, clean) and torch.equal(lse, clean_lse)):
                        bad += 1
                        worst = max(worst, (out.float() - clean.float()).abs().max().item())
                        tokens.update((out != clean).any(dim=(1, 2)).nonzero().flatten()[:8].tolist())
                row = {"causal": causal, "q_tokens": lq, "k_tokens": lk, "v_written_by": producer, "enable_pdl": pdl,
                       "trials": args.trials, "runs_differing_from_idle_run": bad, "worst_abs_difference": worst,
                       "some_differing_tokens": sorted(tokens)[:16]}  # fmt: skip
                print(json.dumps(row), flush=True)
                results.append(row)
    return {"flashinfer": flashinfer.__version__, "runs": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    calls = sub.add_parser("calls", help="check every attention call of a chunked prefill in isolation")
    calls.add_argument("--backend", default="FLASHINFER")
    calls.add_argument("--compare", default=None, help="another backend run on the same inputs (e.g. FLASH_ATTN)")
    calls.add_argument("--model", default="deepseek-v3")
    calls.add_argument("--device", default="cuda")
    calls.add_argument("--layers", type=int, default=3)
    calls.add_argument("--tokens", type=int, default=32768)
    calls.add_argument("--chunk", type=int, default=8192)
    bisect = sub.add_parser("bisect", help="chunked prefill vs float32 with a sync before/after every attention call")
    bisect.add_argument("--syncs", nargs="+", default=["none", "before", "after"], choices=("none", "before", "after", "both"))
    bisect.add_argument("--repeats", type=int, default=2)
    record = sub.add_parser("record", help="copy every call's inputs and output on the stream, check them afterwards")
    for p in (bisect, record):
        p.add_argument("--backend", default="FLASHINFER")
        p.add_argument("--model", default="deepseek-v3")
        p.add_argument("--device", default="cuda")
        p.add_argument("--layers", type=int, default=3)
        p.add_argument("--tokens", type=int, default=32768)
        p.add_argument("--chunk", type=int, default=8192)
    merge = sub.add_parser("merge", help="the Triton merge alone, in place and not, both LSE layouts")
    merge.add_argument("--trials", type=int, default=10)
    merge.add_argument("--unpatched", action="store_true", help="merge an aliased output LSE in place (the bug)")
    race = sub.add_parser("race", help="one call at DeepSeek shapes, many times, PDL on and off")
    race.add_argument("--trials", type=int, default=50)
    for p in (calls, bisect, record, merge, race):
        p.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    modes = {"calls": probe_calls, "bisect": probe_bisect, "record": probe_record, "merge": probe_merge, "race": probe_race}
    result = modes[args.mode](args)
    payload = {"benchmark": f"probe_flashinfer {args.mode}", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **machine(), "args": {k: str(v) for k, v in vars(args).items()}, **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
