"""The ``mlapool`` command line.

    mlapool prefill [--model tiny] [--tp N] [--pcp N] [--random-tokens N | --tokens FILE] [--output-dir DIR] [--verify] ...
    mlapool backends [--dtype bfloat16] [--model deepseek-v3]

``prefill`` starts a prefill pool (on the Ray cluster at ``$RAY_ADDRESS``, or an
embedded local Ray), prefills one prompt, writes each layer's latent KV rows to
``DIR/kv.safetensors`` and a JSON summary (TTFT, tokens/s, the backend chosen)
to ``DIR/summary.json``, and prints the summary. ``--verify`` also runs the
single-process reference (float32, on this machine's CPU) and reports the
largest differences. ``backends`` shows which MLA prefill backend this machine
would use and why each other one was rejected.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from attention.backends.base import DeviceCapability, MLAPrefillSelectorConfig
from attention.backends.registry import MLAPrefillBackendEnum
from attention.backends.selector import ENV_BACKEND, backend_priorities, backend_reasons, get_mla_prefill_backend
from attention.mla import DEFAULT_WORKSPACE_TOKENS
from configs.model import DTYPES, EP_SCHEDULES, FP8_GEMMS, MOE_ROUNDINGS, builtin_models, load_model_config
from configs.pool import DEVICES, PCP_STRATEGIES, QUANTIZATIONS, PoolConfig

BACKEND_CHOICES = ["AUTO"] + [m.name for m in MLAPrefillBackendEnum]
DEFAULTS = PoolConfig()
# --verify tolerances on logits and KV, relative to their largest magnitude
VERIFY_RTOL = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 1e-2}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:  # the user's input
        parser.exit(2, f"mlapool {args.command}: error: {exc}\n")
    except RuntimeError as exc:  # the pool could not start or serve
        parser.exit(1, f"mlapool {args.command}: failed: {exc}\n")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlapool", description="Prefill for DeepSeek-style MLA models on a Ray pool.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log backend selection, planning and pool start")
    sub = parser.add_subparsers(dest="command", required=True)

    prefill = sub.add_parser("prefill", help="prefill one prompt on a pool and write its latent KV cache")
    add_pool_arguments(prefill)
    prompt = prefill.add_argument_group("prompt").add_mutually_exclusive_group()
    prompt.add_argument("--random-tokens", type=int, metavar="N", help="prefill N random token ids (default: 1024)")
    prompt.add_argument("--tokens", type=Path, metavar="FILE", help="token ids: a JSON list or whitespace-separated integers")
    out = prefill.add_argument_group("output")
    out.add_argument("--output-dir", type=Path, default=Path("mlapool-out"), help="where kv.safetensors and summary.json go (default: ./mlapool-out)")
    out.add_argument("--verify", action="store_true", help="compare with the single-process reference (float32, CPU) and report the max error")
    prefill.set_defaults(run=_prefill)

    backends = sub.add_parser("backends", help="show which MLA prefill backend this machine would use, and why")
    backends.add_argument("--model", default="deepseek-v3", help="model whose head dims to check (default: deepseek-v3)")
    backends.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    backends.add_argument("--device", default="auto", choices=DEVICES)
    backends.set_defaults(run=_backends)
    return parser


def add_pool_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and pool options, shared by ``mlapool prefill`` and the batch job (``cluster.job``)."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=DEFAULTS.model, help=f"built-in model ({', '.join(builtin_models())}) or a config.json (default: tiny)")
    model.add_argument("--checkpoint", type=Path, help="HF checkpoint directory (config.json + safetensors); default: seeded random weights")
    model.add_argument("--num-layers", type=int, help="run only the first N layers")
    model.add_argument("--seed", type=int, default=DEFAULTS.seed, help="seed of the random weights and random tokens (default: 0)")
    pool = parser.add_argument_group("pool")
    pool.add_argument("--tp", type=int, default=DEFAULTS.tp, help="tensor-parallel degree: splits the heads (default: 1)")
    pool.add_argument("--pcp", type=int, default=DEFAULTS.pcp,
                      help="prefill-context-parallel degree: splits the tokens and the KV cache; a replica has tp x pcp workers (default: 1)")  # fmt: skip
    pool.add_argument("--pcp-strategy", default=DEFAULTS.pcp_strategy, choices=PCP_STRATEGIES,
                      help="context attention under PCP: merge partial outputs (sharded), all-gather the KV (gather), or pick per batch by cost (auto, the default)")  # fmt: skip
    pool.add_argument("--kv-cache-tokens", type=int, help="KV cache capacity per worker in tokens (default: what GPU memory allows; 262144 on CPU)")
    pool.add_argument("--backend", default="auto", type=str.upper, choices=BACKEND_CHOICES, metavar="NAME",
                      help=f"MLA prefill backend: auto or one of {', '.join(BACKEND_CHOICES[1:])} (default: auto, which honours ${ENV_BACKEND})")  # fmt: skip
    pool.add_argument("--dtype", default=DEFAULTS.dtype, choices=["auto", *DTYPES], help="compute dtype (default: the model's on GPU, float32 on CPU)")
    pool.add_argument("--quantization", default=DEFAULTS.quantization, choices=QUANTIZATIONS,
                      help="auto (default): an FP8 checkpoint's layers run as FP8 GEMMs on SM90 GPUs in bfloat16 and are dequantized at load elsewhere; none: always dequantized")  # fmt: skip
    pool.add_argument("--ep-schedule", default=DEFAULTS.ep_schedule, choices=EP_SCHEDULES,
                      help="how MoE layers order their expert-parallel work (all-to-all, the default: every routed row through the all-to-all; "
                           "local-first: a worker's own pairs computed while the others travel; two-micro-batches: DeepSeek's overlap)")  # fmt: skip
    pool.add_argument("--ep-comm-sms", type=int, default=DEFAULTS.ep_comm_sms,
                      help="SMs that kernels beside an expert-parallel all-to-all leave to it, and the most CTAs it may use (CUDA; default: 0, none)")
    pool.add_argument("--moe-rounding", default=DEFAULTS.moe_rounding, choices=MOE_ROUNDINGS,
                      help="where MoE layers round: reference (transformers', the default) or vllm (as vLLM's CUDA path: "
                           "handed-off KV closer to a vLLM decode server's own; one-worker replicas, unquantized experts)")  # fmt: skip
    pool.add_argument("--fp8-gemm", default=DEFAULTS.fp8_gemm, choices=FP8_GEMMS,
                      help="what runs an FP8 checkpoint's GEMMs on SM90 GPUs: torch (its block-scaled and row-wise grouped GEMMs), "
                           "deep_gemm (DeepGEMM's, on the checkpoint's 128x128 weight blocks; needs the deep_gemm package) or "
                           "auto (deep_gemm where it imports, else torch; the default)")  # fmt: skip
    pool.add_argument("--device", default=DEFAULTS.device, choices=DEVICES, help="worker device (default: cuda when the workers see a GPU)")
    pool.add_argument("--chunk-tokens", type=int, default=DEFAULTS.chunk_tokens, help=f"prefill the prompt in chunks of this many tokens (default: {DEFAULTS.chunk_tokens})")
    pool.add_argument("--workspace-tokens", type=int, default=DEFAULT_WORKSPACE_TOKENS,
                      help=f"bound on cached-context rows up-projected at once (default: {DEFAULT_WORKSPACE_TOKENS})")  # fmt: skip
    pool.add_argument("--replicas", type=int, default=DEFAULTS.replicas, help="independent TP x PCP groups serving in parallel (default: 1)")
    pool.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                      help="prefill every prompt from its first token (default: prompts reuse the KV of full blocks cached from earlier ones)")  # fmt: skip
    pool.add_argument("--cuda-graph-tokens", type=int, nargs="*", default=list(DEFAULTS.cuda_graph_tokens), metavar="N",
                      help="token counts at which a one-GPU replica captures its forward as CUDA graphs; a single prompt up to "
                           f"the largest is replayed, not launched kernel by kernel (none given: always eager; default: "
                           f"{' '.join(map(str, DEFAULTS.cuda_graph_tokens))})")  # fmt: skip


def pool_config(args: argparse.Namespace) -> PoolConfig:
    """The :class:`PoolConfig` of :func:`add_pool_arguments`' options."""
    return PoolConfig(
        model=args.model,
        checkpoint=str(args.checkpoint) if args.checkpoint else None,
        num_layers=args.num_layers,
        tp=args.tp,
        pcp=args.pcp,
        pcp_strategy=args.pcp_strategy,
        replicas=args.replicas,
        kv_cache_tokens=args.kv_cache_tokens,
        backend=args.backend,
        dtype=args.dtype,
        quantization=args.quantization,
        ep_schedule=args.ep_schedule,
        ep_comm_sms=args.ep_comm_sms,
        moe_rounding=args.moe_rounding,
        fp8_gemm=args.fp8_gemm,
        device=args.device,
        chunk_tokens=args.chunk_tokens,
        max_batch_tokens=max(args.chunk_tokens, DEFAULTS.max_batch_tokens),
        workspace_tokens=args.workspace_tokens,
        prefix_caching=args.prefix_caching,
        cuda_graph_tokens=tuple(args.cuda_graph_tokens),
        seed=args.seed,
    )


def save_kv(kv: torch.Tensor, path: Path) -> None:
    """Write a request's KV ``[layers, tokens, width]`` as safetensors ``layers.{i}.latent`` (via a temporary
    file and a rename, so a reader never sees a partial file)."""
    from safetensors.torch import save_file

    partial = path.with_name(path.name + ".partial")
    save_file({f"layers.{i}.latent": kv[i].contiguous() for i in range(kv.shape[0])}, partial)
    partial.replace(path)


def prompt_limit(config: PoolConfig, model_config) -> tuple[int, str]:
    """The longest prompt a pool of ``config`` takes, as far as it is known before the pool starts,
    and what sets it: the model's positions, and the KV cache when its size does not depend on GPU
    memory (``kv_cache_tokens`` given, or CPU workers). A GPU pool sized by memory refuses a prompt
    that does not fit at submit, once it is up, before anything runs."""
    from workers.kv_cache import blocks_for
    from workers.worker import CPU_KV_CACHE_TOKENS

    limit, why = model_config.max_position_embeddings, f"{model_config.name} has {model_config.max_position_embeddings} positions"
    per_worker = config.kv_cache_tokens or (CPU_KV_CACHE_TOKENS if config.device == "cpu" else None)
    if per_worker is not None:
        capacity = blocks_for(per_worker, config.block_size) * config.block_size * config.pcp
        if capacity < limit:
            limit, why = capacity, f"the KV cache holds {capacity} tokens ({per_worker} per worker x pcp={config.pcp})"
    return limit, why


def check_prompt(tokens: list[int], limit: tuple[int, str], vocab_size: int) -> None:
    """``ValueError`` for a prompt no pool of this configuration could take."""
    if len(tokens) > limit[0]:
        raise ValueError(f"prompt of {len(tokens)} tokens is longer than {limit[0]}: {limit[1]}")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_output_dir(path: Path, option: str) -> None:
    """Create ``path`` (a folder) now, or ``ValueError`` saying why it cannot be one."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot create it ({exc.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: not writable")


def _read_tokens(path: Path) -> list[int]:
    text = path.read_text()
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else text.split()
        return [int(v) for v in values]
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: token ids must be a JSON list or whitespace-separated integers ({exc})") from None


class _ProgressBar:
    """``prefill [#####.....] 4096/8192 tokens`` on stderr, when it is a terminal."""

    def __init__(self, stream=sys.stderr, width: int = 30) -> None:
        self.stream, self.width = stream, width
        self.enabled = stream.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        filled = self.width * done // total
        self.stream.write(f"\rprefill [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} tokens")
        if done == total:
            self.stream.write("\n")
        self.stream.flush()


def _prefill(args: argparse.Namespace) -> int:
    from cluster.pool import PrefillPool

    config = pool_config(args)
    model_config = config.model_config()
    limit = prompt_limit(config, model_config)  # everything that can be checked before Ray starts is
    check_output_dir(args.output_dir, "--output-dir")
    if args.tokens:
        tokens = _read_tokens(args.tokens)
        check_prompt(tokens, limit, model_config.vocab_size)
    else:
        count = 1024 if args.random_tokens is None else args.random_tokens
        if count <= 0:
            raise ValueError(f"--random-tokens must be positive, got {count}")
        if count > limit[0]:
            raise ValueError(f"--random-tokens {count} is longer than {limit[0]}: {limit[1]}")
        gen = torch.Generator().manual_seed(args.seed)
        tokens = torch.randint(0, model_config.vocab_size, (count,), generator=gen).tolist()

    started = time.perf_counter()
    with PrefillPool(config) as pool:
        pool.start()
        info = pool.worker_infos[0][0]
        startup = time.perf_counter() - started
        result = pool.prefill(tokens, keep_kv=True, on_progress=_ProgressBar())
        kv = pool.fetch_kv(result)
        pool.release(result)
        stats = pool.stats
        weights, expert_load = pool.weights_report(), pool.expert_load()

    kv_file = args.output_dir / "kv.safetensors"
    save_kv(kv, kv_file)
    summary = {
        "model": model_config.name,
        "model_fingerprint": model_config.fingerprint(),
        "layers": model_config.num_hidden_layers,
        "tokens": result.num_tokens,
        "cached_tokens": result.cached_tokens,
        "tp": config.tp,
        "pcp": config.pcp,
        "backend": info.backend,
        "device": info.device,
        "dtype": info.dtype,
        "weights": weights,
        "pool_startup_s": round(startup, 2),
        "warmup_s": info.warmup_s,
        "ttft_s": round(result.ttft_s, 4),
        "tokens_per_s": round(result.num_tokens / result.ttft_s, 1),
        "first_token": result.first_token,
        "kv_file": str(kv_file),
        "kv_layout": f"per layer [tokens, {model_config.attention.latent_dim}] = [kv_c_normed | k_pe]",
    }
    if expert_load is not None:
        summary["expert_load"] = expert_load
    if config.pcp > 1:
        summary["pcp_context"] = {"batches_per_strategy": stats.pcp_strategies, "bytes_received_per_worker": stats.pcp_bytes}
    if args.verify:
        summary["verify"] = _verify(config, model_config, tokens, result.logits, kv, info)
    (args.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0 if summary.get("verify", {}).get("ok", True) else 1


def _verify(config: PoolConfig, model_config, tokens: list[int], logits: torch.Tensor, kv: torch.Tensor, info) -> dict:
    """Run the single-process reference (float32, CPU, TORCH_SDPA) and compare.

    Random weights are drawn on the workers' device type, so the reference draws
    its own there too (a GPU pool's random weights need CUDA in this process)."""
    from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
    from attention.mla import plan_prefill_batch
    from workers.model import DeepseekPrefillModel
    from workers.weights import load_weights

    reference = DeepseekPrefillModel.create(model_config, TorchSDPAPrefillBackend, dtype=torch.float32)
    draw_on = torch.device(info.device).type
    if not config.checkpoint and draw_on == "cuda" and not torch.cuda.is_available():
        raise ValueError("--verify of random weights drawn on GPU workers needs CUDA here; pass --checkpoint instead")
    load_weights(reference, config.checkpoint, config.seed, draw_device=draw_on)
    out = reference(torch.tensor(tokens), plan_prefill_batch([len(tokens)], workspace_tokens=config.workspace_tokens))
    ref_kv = torch.stack(out.latents)
    logits_err = (logits.float() - out.logits[0]).abs().max().item()
    kv_err = (kv.float() - ref_kv).abs().max().item()
    rtol = VERIFY_RTOL[info.dtype]
    ok = logits_err <= rtol * out.logits.abs().max().item() and kv_err <= rtol * ref_kv.abs().max().item()
    return {
        "reference": "single process, float32, cpu, TORCH_SDPA",
        "max_abs_err_logits": logits_err,
        "max_abs_err_kv": kv_err,
        "same_first_token": int(out.logits[0].argmax()) == int(logits.argmax()),
        "relative_tolerance": rtol,
        "ok": ok,
    }


def _backends(args: argparse.Namespace) -> int:
    config = load_model_config(args.model)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here; valid: cpu, auto")
    device = DeviceCapability.of(None if args.device == "auto" else args.device)
    selector_config = MLAPrefillSelectorConfig(DTYPES[args.dtype], config.attention.dims)
    print(f"device {device}, dtype {args.dtype}, head dims {config.attention.dims}")
    print(f"priority order: {', '.join(m.name for m in backend_priorities(device))}")
    for member in MLAPrefillBackendEnum:
        if member is MLAPrefillBackendEnum.CUSTOM and not member.is_overridden():
            continue
        _, reasons = backend_reasons(member, device, selector_config)
        print(f"  {member.name:17} {'ok' if not reasons else 'no: ' + '; '.join(reasons)}")
    try:
        chosen = get_mla_prefill_backend(selector_config, device).name
    except ValueError as exc:
        chosen = f"none ({exc})"
    print(f"selected: {chosen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
