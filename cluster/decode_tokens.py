"""The rest of an answer asked of a decode server as token ids, its text made here.

vLLM's ``/v1/completions`` detokenizes what it generates: for each request its API server primes a
``tokenizers.DecodeStream`` with the whole prompt (vLLM 0.26 and 0.32), and the first token it
answers pays for decoding the prompt, which the tier's answer pays between its first token and its
second (vLLM alone pays it before its first): on an H100 host, from vLLM's forward launched to the
tier relaying that token, 44.6 ms at 32K through ``/v1/completions`` against 8.6 ms here. vLLM's
tokens-in, tokens-out endpoint (``POST /inference/v1/generate``, its ``SamplingParams`` with
``detokenize: false``) skips it; this module asks the rest of an answer there and makes its text
here from a stream primed with the prompt's last few tokens, which gives the same text: a byte-level
or metaspace decoder's output for new tokens depends on what precedes them only through a character
split across tokens, and the tail starts on a whole character.

Only answers whose first token the tier sampled come this way (``cluster.first_token``: the
parameters are the few the tier reproduces, no stop strings, log-probabilities or penalties, special
tokens skipped). Their sampling parameters are sent explicitly, the checkpoint's generation defaults
included (``FirstToken.forwarded``): the generate endpoint does not apply them as the completions
endpoint does. A generated token that ends the answer with reason ``stop`` (the end of sequence, a
``stop_token_ids`` id) is left out of the text and counted, as vLLM's completions do, and its
``stop_reason`` is the id unless it is the end of sequence. A tokenizer without the Rust backend
(not a fast one) keeps ``/v1/completions``, as does a server without the endpoint (vLLM 0.32
not started with ``--enable-scale-out``), which is asked the same answer there instead
(``openai_api.open_upstream``). ``ServeConfig.decode_endpoint: completions`` turns this off.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# the forward's parameters that are vLLM SamplingParams fields of the same name and meaning
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos", "min_tokens",
            "repetition_penalty", "presence_penalty", "frequency_penalty")  # fmt: skip
# the forward's other keys: the request's own, or read by the tier (never sent on silently)
OWN = frozenset({"model", "prompt", "stream", "stream_options", "kv_transfer_params", "return_token_ids", "user", "stop"})
TAIL_TOKENS = 6  # the prompt's tokens a stream is primed with (more when they start inside a character)


def generate_body(forward: dict[str, Any]) -> dict[str, Any]:
    """``forward`` (a completion request of the tier's: the prompt's ids, the ticket, sampling
    parameters) as the body of vLLM's ``/inference/v1/generate``, its tokens not detokenized."""
    unknown = sorted(k for k, v in forward.items() if v is not None and k not in OWN and k not in SAMPLING)
    if unknown or forward.get("stop"):
        raise ValueError(f"the generate endpoint does not take {unknown or ['stop']}: such a request goes to /v1/completions")
    sampling = {k: forward[k] for k in SAMPLING if forward.get(k) is not None}
    sampling.update(detokenize=False, extra_args={"kv_transfer_params": forward["kv_transfer_params"]})
    body = {"model": forward["model"], "token_ids": forward["prompt"], "sampling_params": sampling, "stream": bool(forward.get("stream"))}
    if body["stream"] and forward.get("stream_options") is not None:
        body["stream_options"] = forward["stream_options"]
    return body


class TokenText:
    """The completion chunks and answers of one decode request to the generate endpoint, its text
    decoded here. ``tokenizer``: a Hugging Face fast tokenizer; ``prompt``: the ids the decode server
    got; ``eos_id``: the tokenizer's end of sequence; ``ignore_eos`` and ``token_ids`` (put the
    generated ids in each choice) as the request says."""

    def __init__(self, tokenizer, prompt: list[int], eos_id: int | None, *, ignore_eos: bool, token_ids: bool, model: str) -> None:
        self.tokenizer, self.eos_id, self.ignore_eos, self.token_ids, self.model = tokenizer, eos_id, ignore_eos, token_ids, model
        self.stream = DecodeStream(skip_special_tokens=True)
        for token in _tail(tokenizer, prompt):
            self.stream.step(tokenizer._tokenizer, token)
        self.created = int(time.time())

    @staticmethod
    def supports(tokenizer) -> bool:
        """Whether ``tokenizer`` has the Rust backend a ``DecodeStream`` steps through (a Hugging Face
        fast tokenizer); answers of another are asked of ``/v1/completions``."""
        return isinstance(getattr(tokenizer, "_tokenizer", None), Tokenizer)

    @classmethod
    def maker(cls, tokenizer, eos_id: int | None, forward: dict[str, Any]) -> Callable[[list[int]], TokenText]:
        """What makes a :class:`TokenText` for the answers of ``forward`` (the tier's completion
        request, its ``ignore_eos`` and ``return_token_ids``), given the prompt a server got."""
        ignore_eos, token_ids, model = forward.get("ignore_eos") is True, forward.get("return_token_ids") is True, forward["model"]
        return lambda prompt: cls(tokenizer, prompt, eos_id, ignore_eos=ignore_eos, token_ids=token_ids, model=model)

    def chunk(self, answer: dict[str, Any]) -> dict[str, Any]:
        """A streamed chunk of the generate endpoint as a completion chunk (an error event as it came)."""
        if "error" in answer:
            return answer
        out = {"id": answer.get("request_id"), "object": "text_completion", "created": self.created, "model": self.model,
               "choices": [self._choice(c) for c in answer.get("choices", [])]}  # fmt: skip
        if answer.get("usage") is not None:
            out["usage"] = answer["usage"]
        return out

    def whole(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The generate endpoint's whole answer as a completion's."""
        out = self.chunk(answer)
        for choice in out["choices"]:
            choice["prompt_logprobs"] = None
        return out

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        ids, finish = list(choice.get("token_ids") or []), choice.get("finish_reason")
        stop_reason = None
        texted = ids
        if finish == "stop" and ids:  # ended by a token: vLLM leaves it out of the text
            texted = ids[:-1]
            if ids[-1] != self.eos_id or self.ignore_eos:
                stop_reason = ids[-1]
        text = "".join(self.stream.step(self.tokenizer._tokenizer, t) or "" for t in texted)
        out = {"index": choice.get("index", 0), "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}
        if self.token_ids:
            out["token_ids"] = ids
        return out


def _tail(tokenizer, prompt: list[int]) -> list[int]:
    """The shortest tail of ``prompt`` of at least ``TAIL_TOKENS`` ids that decodes to whole
    characters (a tail starting inside a multi-byte character decodes to a replacement character)."""
    for n in range(min(TAIL_TOKENS, len(prompt)), min(len(prompt), 4 * TAIL_TOKENS) + 1):
        tail = prompt[-n:]
        if "\ufffd" not in tokenizer.decode(tail, skip_special_tokens=True):
            return tail
    return prompt[-4 * TAIL_TOKENS :]
