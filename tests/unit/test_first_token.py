"""The OpenAI endpoint's first token (cluster.first_token): which requests the tier samples itself and
which it leaves to vLLM, the sampling, when the first token ends the answer, its text, and vLLM's
answer shifted behind it (end to end with a real vLLM: tests/ray/test_openai_endpoint.py)."""

import json
import re

import pytest
import torch

from cluster.first_token import FirstToken, first_chunk, generation_defaults, shift, token_text

EOS = 9


@pytest.mark.parametrize("params, reason", [
    ({"logprobs": 2}, "vLLM samples with \\['logprobs'\\]"),
    ({"temperature": 0, "presence_penalty": 0.5, "logit_bias": {}}, "\\['logit_bias', 'presence_penalty'\\]"),
    ({"stop": ["w3"]}, "stop strings are matched by vLLM"),
    ({"temperature": "hot"}, "temperature='hot' is vLLM's to judge"),
    ({"max_tokens": -3}, "out of range"),
    ({"top_p": 0}, "out of range"),
    ({"stop_token_ids": [1, "x"]}, "stop_token_ids=\\[1, 'x'\\]"),
], ids=["logprobs", "penalties", "stop-strings", "type", "max-tokens", "top-p", "stop-ids"])  # fmt: skip
def test_what_the_tier_does_not_reproduce_is_left_to_vllm_with_the_reason(params, reason):
    plan = FirstToken.plan(params, {}, EOS)
    assert isinstance(plan, str)
    assert re.search(reason, plan), plan


def test_parameters_at_values_that_change_no_token_keep_the_first_token_the_tiers():
    """vLLM's serving benchmark sends repetition_penalty 1.0 and logprobs null with every request."""
    assert isinstance(FirstToken.plan({"repetition_penalty": 1.0, "logprobs": None, "presence_penalty": 0, "min_tokens": 0, "max_tokens": 8}, {}, EOS), FirstToken)
    assert FirstToken.plan({"repetition_penalty": 1.1}, {}, EOS) == "vLLM samples with ['repetition_penalty']"


def test_a_plan_takes_the_request_then_the_checkpoints_defaults_then_vllms():
    plan = FirstToken.plan({"top_k": 5, "seed": 3, "max_tokens": 8, "stop": [], "user": "u"}, {"temperature": 0.6, "top_p": 0.9, "top_k": 50}, EOS)
    assert (plan.temperature, plan.top_p, plan.top_k, plan.min_p, plan.seed, plan.max_tokens) == (0.6, 0.9, 5, 0.0, 3, 8)
    assert plan.stop_ids == {EOS} and not plan.greedy
    bare = FirstToken.plan({}, {}, None)
    assert (bare.temperature, bare.top_p, bare.top_k, bare.max_tokens, bare.stop_ids) == (1.0, 1.0, 0, None, frozenset())
    assert FirstToken.plan({}, {"repetition_penalty": 1.1}, EOS) == "the checkpoint's generation_config sets a repetition penalty"
    # the decode server gets the defaults the request left to the checkpoint, explicitly (vLLM's generate endpoint applies none)
    assert plan.forwarded({"top_k": 5, "seed": 3, "max_tokens": 8}) == {"top_k": 5, "seed": 3, "max_tokens": 7, "temperature": 0.6, "top_p": 0.9}


def test_a_completion_without_max_tokens_has_vllms_16_and_a_chat_the_rest_of_the_context():
    completion = FirstToken.plan({"max_tokens": None}, {}, EOS, default_max_tokens=16)
    assert completion.max_tokens == 16 and completion.forwarded({"max_tokens": None}) == {"max_tokens": 15}
    chat = FirstToken.plan({}, {}, EOS)
    assert chat.max_tokens is None and chat.forwarded({}) == {}


def test_end_of_sequence_stop_ids_and_length_end_the_answer_at_its_first_token():
    plan = FirstToken.plan({"stop_token_ids": [4], "max_tokens": 2}, {"eos_token_id": [EOS, 7]}, EOS)
    assert plan.stop_ids == {4, 7, EOS}
    assert [plan.finish(t) for t in (4, 7, EOS, 5)] == ["stop", "stop", "stop", None]
    ignoring = FirstToken.plan({"ignore_eos": True, "max_completion_tokens": 1}, {"eos_token_id": [EOS, 7]}, EOS)
    assert ignoring.stop_ids == {7}  # the config's other end ids stop even with ignore_eos (as in vLLM)
    assert ignoring.finish(EOS) == "length" and ignoring.finish(5) == "length"
    assert ignoring.forwarded({"max_completion_tokens": 1, "user": "u"}) == {"max_tokens": 0, "user": "u"}
    assert plan.forwarded({"max_tokens": 2, "stop_token_ids": [4]}) == {"max_tokens": 1, "stop_token_ids": [4]}


def test_sampling_greedy_seeded_and_truncated():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])
    assert FirstToken.plan({"temperature": 0}, {}, None).sample(logits) == 1
    seeded = FirstToken.plan({"temperature": 1.0, "seed": 7}, {}, None)
    assert len({seeded.sample(logits) for _ in range(5)}) == 1  # a seed gives the same token every time
    assert {FirstToken.plan({"top_k": 2}, {}, None).sample(logits) for _ in range(200)} == {1, 2}
    assert {FirstToken.plan({"top_p": 0.3}, {}, None).sample(logits) for _ in range(50)} == {1}
    assert {FirstToken.plan({"min_p": 0.5}, {}, None).sample(logits) for _ in range(200)} == {1, 2}
    counts = torch.bincount(torch.tensor([FirstToken.plan({"temperature": 100.0}, {}, None).sample(logits) for _ in range(500)]), minlength=5)
    assert (counts > 50).all()  # a high temperature flattens the distribution: every token drawn


def test_generation_defaults_come_from_the_checkpoint(tmp_path):
    assert generation_defaults(str(tmp_path)) == {} and generation_defaults(None) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "eos_token_id": 1}))
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.3, "eos_token_id": 1}


class WordTokenizer:
    """Decodes as a word-level tokenizer does (the suite's vLLM checkpoints have one); id 0 is special,
    id 1 half of a multi-byte character."""

    def decode(self, ids, skip_special_tokens=True):
        words = [("\ufffd" if i == 1 else f"w{i}") for i in ids if not (skip_special_tokens and i == 0)]
        return " ".join(words)


def test_the_first_tokens_text_is_what_it_adds_after_the_prompt():
    tokenizer = WordTokenizer()
    assert token_text(tokenizer, [5, 6, 7], 8) == " w8"
    assert token_text(tokenizer, [5, 6, 7], 0) == ""  # a special token adds nothing
    assert token_text(tokenizer, [5, 6, 7], 1) is None  # not whole on its own: vLLM samples it


def test_vllms_answer_is_shifted_behind_the_first_token():
    head = first_chunk("cmpl-r1", "m", 1, " w8", 8, None, [5, 6, 7])
    upstream = {"id": "cmpl-vllm", "choices": [{"index": 0, "text": " w9 w10", "prompt_token_ids": [5, 6, 7, 8], "token_ids": [9, 10],
                                                "finish_reason": "length"}],
                "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}  # fmt: skip
    whole = shift(upstream, "cmpl-r1", head)
    assert whole["id"] == "cmpl-r1" and whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert whole["choices"][0] == {"index": 0, "text": " w8 w9 w10", "prompt_token_ids": [5, 6, 7], "token_ids": [8, 9, 10], "finish_reason": "length"}
    chunk = shift({"id": "cmpl-vllm", "choices": [{"index": 0, "text": " w9", "prompt_token_ids": [5, 6, 7, 8], "token_ids": [9]}]}, "cmpl-r1")
    assert chunk == {"id": "cmpl-r1", "choices": [{"index": 0, "text": " w9", "token_ids": [9]}]}
