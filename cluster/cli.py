"""The ``mlapool`` command line.

    mlapool prefill [--model tiny] [--random-tokens N | --tokens FILE] [--output-dir DIR] ...
    mlapool backends [--dtype bfloat16] [--model tiny]

``prefill`` runs one prompt through the model in this process, writes each
layer's latent KV rows to ``DIR/kv.safetensors`` and a JSON summary (TTFT,
tokens/s, the backend chosen) to ``DIR/summary.json``, and prints the summary.
``backends`` shows which MLA prefill backend this machine would use and why
each other one was rejected.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from attention.backends.base import DeviceCapability, MLAPrefillSelectorConfig
from attention.backends.registry import MLAPrefillBackendEnum
from attention.backends.selector import ENV_BACKEND, backend_priorities, backend_reasons, get_mla_prefill_backend
from attention.mla import DEFAULT_WORKSPACE_TOKENS, plan_prefill_batch
from configs.model import DTYPES, builtin_models, load_model_config

BACKEND_CHOICES = ["AUTO"] + [m.name for m in MLAPrefillBackendEnum]


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        parser.exit(2, f"mlapool {args.command}: error: {exc}\n")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlapool", description="Prefill for DeepSeek-style MLA models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log backend selection and planning")
    sub = parser.add_subparsers(dest="command", required=True)

    prefill = sub.add_parser("prefill", help="prefill one prompt and write its latent KV cache")
    prefill.add_argument("--model", default="tiny", help=f"built-in model ({', '.join(builtin_models())}) or a config.json / checkpoint directory (default: tiny)")
    prefill.add_argument("--num-layers", type=int, help="run only the first N layers")
    source = prefill.add_mutually_exclusive_group()
    source.add_argument("--random-tokens", type=int, metavar="N", help="prefill N random token ids (default: 1024)")
    source.add_argument("--tokens", type=Path, metavar="FILE", help="token ids: a JSON list or whitespace-separated integers")
    prefill.add_argument("--seed", type=int, default=0, help="seed of the random weights and random tokens (default: 0)")
    prefill.add_argument("--backend", default="auto", type=str.upper, choices=BACKEND_CHOICES,
                         help=f"MLA prefill backend, case-insensitive (default: auto, which honours ${ENV_BACKEND})")  # fmt: skip
    prefill.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="compute dtype (default: the model's; float32 on CPU)")
    prefill.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda if available)")
    prefill.add_argument("--workspace-tokens", type=int, default=DEFAULT_WORKSPACE_TOKENS,
                         help=f"bound on cached-context rows up-projected at once (default: {DEFAULT_WORKSPACE_TOKENS})")  # fmt: skip
    prefill.add_argument("--output-dir", type=Path, default=Path("mlapool-out"), help="where kv.safetensors and summary.json go (default: ./mlapool-out)")
    prefill.set_defaults(run=_prefill)

    backends = sub.add_parser("backends", help="show which MLA prefill backend this machine would use, and why")
    backends.add_argument("--model", default="deepseek-v3", help="model whose head dims to check (default: deepseek-v3)")
    backends.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    backends.add_argument("--device", default="auto")
    backends.set_defaults(run=_backends)
    return parser


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is available here; valid: cpu")
    return device


def _read_tokens(path: Path) -> list[int]:
    text = path.read_text()
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else text.split()
        tokens = [int(v) for v in values]
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: token ids must be a JSON list or whitespace-separated integers ({exc})") from None
    if not tokens:
        raise ValueError(f"{path}: the prompt is empty")
    return tokens


def _prefill(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from workers.model import DeepseekPrefillModel

    overrides = {"num_hidden_layers": args.num_layers} if args.num_layers else {}
    config = load_model_config(args.model, **overrides)
    device = _device(args.device)
    dtype = torch.float32 if device.type == "cpu" and args.dtype == "auto" else DTYPES.get(args.dtype, config.dtype)
    backend_cls = get_mla_prefill_backend(
        MLAPrefillSelectorConfig(dtype, config.attention.dims),
        DeviceCapability.of(device),
        None if args.backend == "AUTO" else args.backend,
    )
    if args.tokens:
        tokens = _read_tokens(args.tokens)
    else:
        count = 1024 if args.random_tokens is None else args.random_tokens
        if count <= 0:
            raise ValueError(f"--random-tokens must be positive, got {count}")
        gen = torch.Generator().manual_seed(args.seed)
        tokens = torch.randint(0, config.vocab_size, (count,), generator=gen).tolist()

    model = DeepseekPrefillModel.create(config, backend_cls, dtype=dtype, device=device)
    model.init_random_weights(args.seed)
    token_ids = torch.tensor(tokens, dtype=torch.int64, device=device)

    started = time.perf_counter()
    batch = plan_prefill_batch([len(tokens)], workspace_tokens=args.workspace_tokens, device=device, backend=model.backend)
    out = model(token_ids, batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ttft = time.perf_counter() - started

    args.output_dir.mkdir(parents=True, exist_ok=True)
    save_file({f"layers.{i}.latent": t.contiguous().cpu() for i, t in enumerate(out.latents)}, args.output_dir / "kv.safetensors")
    summary = {
        "model": config.name,
        "model_fingerprint": config.fingerprint(),
        "layers": config.num_hidden_layers,
        "tokens": len(tokens),
        "backend": backend_cls.name,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "ttft_s": round(ttft, 4),
        "tokens_per_s": round(len(tokens) / ttft, 1),
        "first_token": int(out.logits[0].argmax()),
        "kv_file": str(args.output_dir / "kv.safetensors"),
        "kv_layout": f"per layer [tokens, {config.attention.latent_dim}] = [kv_c_normed | k_pe]",
    }
    (args.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


def _backends(args: argparse.Namespace) -> int:
    config = load_model_config(args.model)
    device = DeviceCapability.of(_device(args.device))
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
