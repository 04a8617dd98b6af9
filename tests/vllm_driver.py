"""Runs stock vLLM (``LLM``, offline) with mlapool's connector in a process of its own, for the tests
and ``benchmarks/bench_vllm_truth.py`` (``vllm_job.VLLMRun`` starts it):

    python tests/vllm_driver.py job.json out.pt < steps.json

``job.json``: ``{"model", "extra_config", "engine": {LLM keywords}, "max_tokens"}``; the steps, a JSON
list read from stdin once vLLM is up (``vllm_job.VLLMRun``: vLLM boots while they are made); a
step is ``{"name", "prompts": [[ids], ...], "tickets": [ticket or null, ...]}`` and runs its prompts
in one ``generate`` call (one at a time when a step has one prompt). For every request ``out.pt``
holds its greedy tokens and its prompt's KV rows as vLLM's cache holds them once it finished,
``[layers, prompt tokens, 576]`` (read from the worker's cache before the next step; those of the
other tensor-parallel ranks in ``other_ranks_rows``, one per rank after the first), the tokens
vLLM counted as cached, and how many it computed in the request's first step. The blocks a request
used and that count come back through ``kv_transfer_params`` from :class:`RecordingConnector`, the
connector under test with ``request_finished`` telling them; ``_mapper`` holds the state of the
first rank's mapped copies at the end (``kv.mapped``: temporaries left, peak within a chunk).
"""

import json
import sys

import torch

from kv.vllm_connector import MlapoolConnector


class RecordingConnector(MlapoolConnector):
    """mlapool's connector, which also returns each finished request's block ids and how many tokens
    vLLM computed in the first step it ran the request (the whole prompt when it prefilled it, 1 when
    it loaded the prompt and computed only its last token)."""

    def build_connector_meta(self, scheduler_output):
        first = getattr(self, "first_step", {})
        for request_id, count in scheduler_output.num_scheduled_tokens.items():
            first.setdefault(request_id, count)
        self.first_step = first
        return super().build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        super().request_finished(request, block_ids)
        grouped = bool(block_ids) and isinstance(block_ids[0], (list, tuple))  # one list per KV cache group, or one list
        first = self.first_step.pop(request.request_id, None)
        return False, {"block_ids": list(block_ids[0] if grouped else block_ids), "first_step_tokens": first}


def _rows(worker, block_ids: list[int], tokens: int) -> torch.Tensor:
    """On the vLLM worker: the request's rows of every layer of the connector's view of the cache, in
    the cache's dtype."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    layers = get_kv_transfer_group().worker.layers
    table = torch.tensor(block_ids, device=layers[0].device)
    return torch.stack([layer.index_select(0, table).reshape(-1, layer.shape[-1])[:tokens].cpu() for layer in layers])


def main(job_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm_cpu_fork import fork_on_cpu  # tests/vllm_cpu_fork.py: on the CPU, vLLM's processes forked as on a GPU

    fork_on_cpu()
    job = json.loads(open(job_path).read())
    transfer = {
        "kv_connector": "RecordingConnector", "kv_connector_module_path": "vllm_driver", "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": job["extra_config"],
    }  # fmt: skip
    llm = LLM(model=job["model"], kv_transfer_config=transfer, **job["engine"])
    greedy = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
    results = {}
    for step in json.load(sys.stdin):
        requests = [{"prompt_token_ids": ids} for ids in step["prompts"]]
        params = [greedy.clone() for _ in requests]
        for param, ticket in zip(params, step["tickets"]):
            if ticket is not None:  # as vLLM's OpenAI server passes a request's kv_transfer_params on
                param.extra_args = {"kv_transfer_params": {"mlapool": ticket}}
        outputs = llm.generate(requests, params, use_tqdm=False)
        for i, out in enumerate(outputs):
            block_ids = out.kv_transfer_params["block_ids"]
            rows, *other_ranks = llm.collective_rpc(_rows, args=(block_ids, len(step["prompts"][i])))
            results[f"{step['name']}/{i}"] = {
                "tokens": list(out.outputs[0].token_ids), "rows": rows, "other_ranks_rows": other_ranks, "cached": out.num_cached_tokens,
                "block_ids": block_ids,
                "first_step_tokens": out.kv_transfer_params["first_step_tokens"],
            }  # fmt: skip
    results["_mapper"] = llm.collective_rpc(_mapper_state)[0]
    torch.save(results, out_path)


def _mapper_state(worker) -> dict:
    """The connector's mapped copies on the vLLM worker: temporaries left (0), and whether the largest
    was within one chunk of rows."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    load = get_kv_transfer_group().worker
    bound = load.mapper.chunk_rows * load.layers[0].shape[-1] * load.layers[0].element_size()
    return {"in_flight_bytes": load.mapper.in_flight_bytes, "peak_bounded": 0 < load.mapper.peak_in_flight_bytes <= bound}


if __name__ == "__main__":
    main(*sys.argv[1:3])
