"""Does the bf16 prefill forward on CUDA read memory it never wrote?

``tests/unit/test_cuda_graphs.py::test_the_replay_writes_what_the_eager_forward_writes[bf16]`` failed
once on an H200 (2026-11-29) when it ran after ``test_model.py``'s GPU test, which leaves gigabytes of
freed blocks of its own values in torch's caching allocator, and passed in the other order. This
probe runs the test's tiny MoE model eagerly and from CUDA graphs on the test's prompts three ways:
plain; after filling and freeing a large block of garbage (what the earlier test leaves); and with
``torch.utils.deterministic.fill_uninitialized_memory`` (every ``torch.empty`` filled with NaN). A
kernel that reads what it never wrote shows up as a difference between the three (NaN in the last).

    python benchmarks/probes/probe_uninitialized_reads.py --out probe.json
"""

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[2] / "tests")]

import numpy as np
import torch
from hf_models import tiny_moe  # tests/hf_models.py
from machine import machine  # benchmarks/machine.py

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from attention.mla import plan_prefill_batch
from configs.model import load_model_config
from workers.cuda_graphs import PrefillGraphs
from workers.model import DeepseekPrefillModel
from workers.weights import load_weights

SIZES, LENGTHS = (16, 64, 256), (200, 1, 16, 17, 64, 256, 3)


def outputs(model, graphs, n):
    ids = np.random.default_rng(n).integers(0, 320, size=n).astype(np.int64)
    size = graphs.size_for(n)
    padded = torch.zeros(size, dtype=torch.int64, device="cuda")
    padded[:n] = torch.from_numpy(ids)
    eager = model.run_layers(padded, plan_prefill_batch([size], device="cuda"), last_index=torch.tensor([n - 1], device="cuda"))
    replay = graphs.run(ids.astype(np.int32))
    return {
        "eager": [eager.logits.float().cpu()] + [x[:n].float().cpu() for x in eager.latents],
        "replay": [replay.logits.float().cpu()] + [x.float().cpu() for x in replay.latents],
    }


def run(path, mode: str, garbage_gib: float):
    torch.cuda.empty_cache()
    if mode == "garbage":  # freed blocks holding values, as test_model's 9 GB test leaves them
        junk = torch.randn(int(garbage_gib * 2**30) // 4, device="cuda") * 1e4
        del junk
    deterministic = mode == "nan-fill"
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = deterministic
    try:
        model = DeepseekPrefillModel.create(load_model_config(path), TorchSDPAPrefillBackend, device="cuda", dtype=torch.bfloat16)
        load_weights(model, path)
        graphs = PrefillGraphs.capture(model, SIZES, torch.device("cuda"))
        got = {n: outputs(model, graphs, n) for n in LENGTHS}
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = False
    del model, graphs
    return got


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--garbage-gib", type=float, default=9.0, help="the freed block's size (test_model's GPU test: ~9 GiB)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the three modes")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    path = tempfile.mkdtemp()
    tiny_moe("v3", seed=3).save_pretrained(path)
    rounds = []
    for r in range(args.repeats):
        got = {mode: run(path, mode, args.garbage_gib) for mode in ("plain", "garbage", "nan-fill")}
        rows = []
        for n in LENGTHS:
            row = {"tokens": n}
            for mode in got:
                for kind in ("eager", "replay"):
                    row[f"{mode}_{kind}_nan"] = any(bool(t.isnan().any()) for t in got[mode][n][kind])
                    row[f"{mode}_{kind}_vs_plain_eager_max_abs"] = max(
                        float((a - b).abs().nan_to_num(float("inf")).max()) for a, b in zip(got[mode][n][kind], got["plain"][n]["eager"])
                    )
            rows.append(row)
        rounds.append(rows)
        print(json.dumps(rows, indent=None)[:4000], flush=True)
    json.dump(
        {
            "what": "the bf16 tiny MoE forward on CUDA, eager and replayed, plain / after freed garbage / NaN-filled empties: max |difference| to the plain eager run",
            "date": datetime.date.today().isoformat(),
            "machine": machine(),
            "garbage_gib": args.garbage_gib,
            "rounds": rounds,
        },
        open(args.out, "w"),
        indent=1,
    )


if __name__ == "__main__":
    main()
