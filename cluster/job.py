"""Batch prefill of a file of prompts: the entry point of ``ray job submit``.

    ray job submit --working-dir . -- python -m cluster.job --input prompts.jsonl --output out/ --tp 2

``--input`` is JSON Lines, one prompt per line: ``{"id": "doc-1", "token_ids": [1, 2, 3]}``, or
``{"id": "doc-2", "text": "..."}`` with ``--tokenizer`` (a Hugging Face ``tokenizer.json``). ``id``
is optional (default ``line-<n>``); ids must be unique and file-name safe. The whole file is checked
before the pool starts: bad lines stop the run (exit 2), each named by line number.

For every prompt the job writes ``OUTPUT/prompts/<id>.kv.safetensors`` (the latent KV, per layer
``layers.<i>.latent [tokens, latent]``) and then ``OUTPUT/prompts/<id>.json`` (tokens, first token,
TTFT, the model's fingerprint, a hash of the token ids), both through a rename, so a prompt is done
exactly when its JSON exists. At the end it writes ``OUTPUT/run_summary.json``. Progress goes to
the job's log as one JSON object per line, with request ids.

Before Ray starts the job checks the output folder, and every prompt against the model's positions,
its vocabulary and (when its size is known then) the KV cache: a prompt that cannot run is
recorded as failed at once and the others go on; the exit status is then 1.

Resuming: run the same command again. Prompts whose JSON exists, for the same token ids and the
same model, are skipped; the rest (never run, failed, interrupted, or changed since) are prefilled.

Stopping: ``ray job stop`` (SIGTERM; also SIGINT), once the pool is up, cancels the prompts in the pool -- they leave it
before their next chunk and their KV is freed --, writes ``run_summary.json`` with them counted as
``cancelled``, and exits with 143 (130 for SIGINT). Finished prompts stay done for the next run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from cluster.cli import add_pool_arguments, check_output_dir, check_prompt, pool_config, prompt_limit, save_kv

ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_REPORTED_ERRORS = 20


@dataclass
class Prompt:
    id: str
    line: int
    token_ids: list[int]

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.token_ids).encode()).hexdigest()[:16]


def read_prompts(path: Path, tokenizer: Path | None) -> list[Prompt]:
    """Every prompt of the JSON Lines file, or ``ValueError`` naming each bad line."""
    encode = _tokenizer(tokenizer) if tokenizer else None
    prompts, errors, seen = [], [], {}
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                prompt = _parse(line, number, encode)
            except ValueError as exc:
                errors.append(f"line {number}: {exc}")
                continue
            if prompt.id in seen:
                errors.append(f"line {number}: id {prompt.id!r} is already used on line {seen[prompt.id]}")
                continue
            seen[prompt.id] = number
            prompts.append(prompt)
    if errors:
        more = f"\n  ... and {len(errors) - MAX_REPORTED_ERRORS} more" if len(errors) > MAX_REPORTED_ERRORS else ""
        raise ValueError(f"{path}: {len(errors)} bad line(s):\n  " + "\n  ".join(errors[:MAX_REPORTED_ERRORS]) + more)
    if not prompts:
        raise ValueError(f"{path}: no prompts (expected JSON Lines of {{\"id\": ..., \"token_ids\": [...]}})")
    return prompts


def _parse(line: str, number: int, encode) -> Prompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    unknown = set(record) - {"id", "token_ids", "text"}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}; valid: id, token_ids, text")
    prompt_id = record.get("id", f"line-{number}")
    if not isinstance(prompt_id, str) or not ID_PATTERN.fullmatch(prompt_id):
        raise ValueError(f"id {prompt_id!r} must be 1-128 characters of letters, digits, '.', '_', '-' (not starting with '.', '_' or '-')")
    if ("token_ids" in record) == ("text" in record):
        raise ValueError("give exactly one of token_ids and text")
    if "text" in record:
        if encode is None:
            raise ValueError("has text, but no --tokenizer was given")
        if not isinstance(record["text"], str) or not record["text"]:
            raise ValueError("text must be a non-empty string")
        return Prompt(prompt_id, number, encode(record["text"]))
    tokens = record["token_ids"]
    if not isinstance(tokens, list) or not tokens or not all(type(t) is int for t in tokens):
        raise ValueError("token_ids must be a non-empty list of integers")
    return Prompt(prompt_id, number, tokens)


def _tokenizer(path: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("--tokenizer needs the 'tokenizers' package: pip install tokenizers") from None
    if not path.is_file():
        raise FileNotFoundError(f"--tokenizer {path}: no such file (expected a Hugging Face tokenizer.json)")
    tokenizer = Tokenizer.from_file(str(path))
    return lambda text: tokenizer.encode(text).ids


def is_done(folder: Path, prompt: Prompt, fingerprint: str) -> bool:
    """Whether an earlier run finished this prompt, for these token ids and this model."""
    try:
        record = json.loads((folder / f"{prompt.id}.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return (
        record.get("tokens_sha256") == prompt.digest
        and record.get("model_fingerprint") == fingerprint
        and (folder / f"{prompt.id}.kv.safetensors").is_file()
    )


def emit(event: str, **fields) -> None:
    """One structured log line on stdout (the job's log)."""
    print(json.dumps({"ts": round(time.time(), 3), "event": event, **fields}), flush=True)


def run(args: argparse.Namespace) -> int:
    from cluster.metrics import PoolMetrics
    from cluster.pool import PrefillPool

    config = pool_config(args)
    model_config = config.model_config()
    fingerprint = model_config.fingerprint()
    prompts = read_prompts(args.input, args.tokenizer)
    check_output_dir(args.output, "--output")
    folder = args.output / "prompts"
    check_output_dir(folder, "--output")
    todo = [p for p in prompts if not is_done(folder, p, fingerprint)]
    skipped = len(prompts) - len(todo)
    started_at, started = datetime.now(timezone.utc), time.perf_counter()
    emit("start", prompts=len(prompts), already_done=skipped, to_run=len(todo), tp=config.tp, pcp=config.pcp, replicas=config.replicas)
    done, failed, tokens, cached, ttfts, info, ready, reports = 0, {}, 0, 0, [], None, started, {}
    limit, runnable = prompt_limit(config, model_config), []
    for prompt in todo:  # before Ray starts
        try:
            check_prompt(prompt.token_ids, limit, model_config.vocab_size)
            runnable.append(prompt)
        except ValueError as exc:
            failed[prompt.id] = str(exc)
            emit("prompt_failed", request_id=prompt.id, line=prompt.line, error=str(exc))
    todo, cancelled, not_started, stop = runnable, [], 0, None
    if todo:
        metrics = PoolMetrics(args.name)
        with PrefillPool(config, metrics=metrics).start() as pool:
            stop = _StopSignal()  # after Ray's start: ray.init installs a SIGTERM handler of its own
            info, ready = pool.worker_infos[0][0], time.perf_counter()
            emit("pool_ready", backend=info.backend, device=info.device, dtype=info.dtype, max_prompt_tokens=pool.max_prompt_tokens)
            pending: dict[Future, Prompt] = {}
            queue = iter(todo)
            while not stop.signal:
                while len(pending) < args.max_in_flight and (prompt := next(queue, None)) is not None:
                    try:
                        pending[pool.submit(prompt.token_ids, request_id=prompt.id, keep_kv=True, return_logits=False)] = prompt
                    except (TypeError, ValueError) as exc:
                        failed[prompt.id] = str(exc)
                        emit("prompt_failed", request_id=prompt.id, line=prompt.line, error=str(exc))
                if not pending:
                    break
                finished, _ = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                for future in finished:
                    prompt = pending.pop(future)
                    try:
                        result = future.result()
                        kv = pool.fetch_kv(result)
                        pool.release(result)
                        save_kv(kv, folder / f"{prompt.id}.kv.safetensors")
                        metrics.shipped(kv.numel() * kv.element_size(), "file")
                    except Exception as exc:  # noqa: BLE001 -- one prompt's failure is recorded, the run goes on
                        failed[prompt.id] = str(exc)
                        emit("prompt_failed", request_id=prompt.id, line=prompt.line, error=str(exc))
                        continue
                    record = {
                        "id": prompt.id,
                        "tokens": result.num_tokens,
                        "cached_tokens": result.cached_tokens,
                        "tokens_sha256": prompt.digest,
                        "first_token": result.first_token,
                        "ttft_s": round(result.ttft_s, 4),
                        "model_fingerprint": fingerprint,
                        "kv_file": f"{prompt.id}.kv.safetensors",
                        "kv_layout": f"per layer [tokens, {kv.shape[2]}] = [kv_c_normed | k_pe], {str(kv.dtype).removeprefix('torch.')}",
                    }
                    partial = folder / f"{prompt.id}.json.partial"
                    partial.write_text(json.dumps(record, indent=2) + "\n")
                    partial.replace(folder / f"{prompt.id}.json")
                    done, tokens, cached = done + 1, tokens + result.num_tokens, cached + result.cached_tokens
                    ttfts.append(result.ttft_s)
                    emit("prompt_done", request_id=prompt.id, tokens=result.num_tokens, ttft_s=round(result.ttft_s, 4),
                         progress=f"{skipped + done}/{len(prompts)}", failed=len(failed),
                         tokens_per_s=round(tokens / (time.perf_counter() - ready), 1))  # fmt: skip
            if stop.signal:  # out of the pool before their next chunk, KV freed
                cancelled = [prompt.id for future, prompt in pending.items() if future.cancel()]
                not_started = sum(1 for _ in queue)
                emit("stopped", signal=stop.signal, cancelled=len(cancelled), not_started=not_started, prefilled=done)
            reports = {"weights": pool.weights_report(), "expert_load": pool.expert_load(), "prefix_cache": pool.prefix_report()}
            stop.restore()
    stopped_by = stop.signal if stop else None
    elapsed = time.perf_counter() - started
    ttfts.sort()
    summary = {
        "input": str(args.input),
        "output": str(args.output),
        "started": started_at.isoformat(timespec="seconds"),
        "wall_s": round(elapsed, 2),
        "prompts": len(prompts),
        "already_done": skipped,
        "prefilled": done,
        "failed": len(failed),
        "failures": failed,
        "cancelled": len(cancelled),
        **({"stopped_by": stopped_by, "not_started": not_started} if stopped_by else {}),
        "tokens_prefilled": tokens,
        "cached_tokens": cached,  # of them, taken from the prefix cache (not computed)
        "tokens_per_s": round(tokens / (time.perf_counter() - ready), 1) if tokens else 0.0,  # since the pool was ready
        "ttft_s": {"p50": round(ttfts[len(ttfts) // 2], 4), "max": round(ttfts[-1], 4)} if ttfts else None,
        "model_fingerprint": fingerprint,
        "pool": {"tp": config.tp, "pcp": config.pcp, "replicas": config.replicas,
                 **({"backend": info.backend, "device": info.device, "dtype": info.dtype} if info else {})},  # fmt: skip
        **reports,  # how each worker holds its weights, and the experts' load per layer (MoE models)
    }
    (args.output / "run_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    emit("finished", prefilled=done, already_done=skipped, failed=len(failed), cancelled=len(cancelled), wall_s=round(elapsed, 2))
    if stopped_by:
        return 128 + signal.Signals[stopped_by].value
    return 1 if failed else 0


class _StopSignal:
    """Notes SIGTERM (``ray job stop``) and SIGINT while the job runs, instead of dying mid-write."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._note)

    def _note(self, signum, frame) -> None:
        self.signal = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.job",
        description="Prefill every prompt of a JSON Lines file on a prefill pool; write each prompt's latent KV "
        "and a summary. Re-running the same command resumes: finished prompts are skipped.",
    )
    io = parser.add_argument_group("input and output")
    io.add_argument("--input", type=Path, required=True, help='JSON Lines: {"id": ..., "token_ids": [...]} or {"id": ..., "text": ...} per line')
    io.add_argument("--output", type=Path, required=True, help="folder for prompts/<id>.kv.safetensors, prompts/<id>.json and run_summary.json")
    io.add_argument("--tokenizer", type=Path, help="a Hugging Face tokenizer.json, for lines with text")
    io.add_argument("--max-in-flight", type=int, default=8, help="prompts submitted to the pool at once (default: 8)")
    io.add_argument("--name", default="batch-job", help="the pool tag of this job's metrics (default: batch-job)")
    add_pool_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.max_in_flight < 1:
        parser().exit(2, f"cluster.job: error: --max-in-flight must be >= 1, got {args.max_in_flight}\n")
    try:
        return run(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:  # the user's input
        print(f"cluster.job: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # the pool could not start
        print(f"cluster.job: failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
