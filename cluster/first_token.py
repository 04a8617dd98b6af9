"""The first token of an OpenAI request, the tier's own: from its prefill's logits.

The pool's prefill ends with the prompt's last token's greedy next token (the worker's argmax) and,
when asked, its logits. For a request whose sampling the tier reproduces (:meth:`FirstToken.plan`),
the endpoint (``cluster.serve``) takes the greedy token or samples one from the logits, sends it to
the client at once, and forwards the prompt followed by that token to a vLLM decode server, with the
ticket of the prompt's KV: vLLM loads the prompt's rows, computes only the new token's (no prompt
token is computed twice) and generates the rest. The client's time to first
token is then the prefill's and the hop's, not theirs plus the KV load and a vLLM step. SGLang's
prefill/decode split works the same way (its prefill server samples the first token).

Reproduced: ``temperature`` (below 1e-5: greedy), ``top_k``, ``top_p``, ``min_p`` and ``seed``, with
vLLM's defaults from the checkpoint's ``generation_config.json`` (as ``vllm serve`` with its default
``--generation-config auto``); ``max_tokens`` (``max_completion_tokens`` in a chat) of 1 and a first
token that is the end of sequence or in ``stop_token_ids`` end the answer here, without a decode
server; ``ignore_eos``, ``return_token_ids`` and ``user``. Any other parameter (log-probabilities,
penalties, logit biases, stop strings, ``min_tokens``, structured output, anything vLLM adds), a
value of an unexpected type, or a first token whose text is not whole on its own (part of a
multi-byte character) leaves the first token to vLLM (a parameter that is null, or at a value that
changes no token, such as ``repetition_penalty`` 1 or a penalty of 0, does not): the prompt goes to it unchanged and it
recomputes the prompt's last token over the loaded KV (``kv.vllm_connector``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy
REPRODUCED = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos",
              "return_token_ids", "user", "stop"}  # fmt: skip
KINDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int, "max_tokens": int, "max_completion_tokens": int,
         "ignore_eos": bool, "return_token_ids": bool}  # fmt: skip
NO_OPS = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0}  # values that change no token
GENERATION_KEYS = {"temperature", "top_p", "top_k", "min_p"}  # generation_config.json defaults vLLM applies that this reproduces


def generation_defaults(checkpoint: str | None) -> dict[str, Any]:
    """The sampling defaults and end-of-sequence ids of a checkpoint's ``generation_config.json``
    (``{}`` without one): what ``vllm serve`` applies to a request that does not say."""
    path = Path(checkpoint or "") / "generation_config.json"
    if not checkpoint or not path.is_file():
        return {}
    return json.loads(path.read_text())


def _number(value: Any, kind: type) -> bool:
    return type(value) is kind or (kind is float and type(value) is int)


@dataclass(frozen=True)
class FirstToken:
    """How to sample one request's first token, and when it ends the answer."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    max_tokens: int | None  # None: vLLM's default (the rest of the context)
    stop_ids: frozenset[int]  # end the answer with reason "stop" (the end of sequence unless ignore_eos, stop_token_ids)
    return_token_ids: bool
    defaults: dict[str, Any]  # the generation_config.json values the request did not override (sent on explicitly)

    @classmethod
    def plan(cls, params: dict[str, Any], defaults: dict[str, Any], eos_id: int | None, default_max_tokens: int | None = None) -> FirstToken | str:
        """The sampling of a request's parameters (``params``: what the endpoint forwards), or why the
        tier does not reproduce it (the first token is then vLLM's). ``default_max_tokens``: the
        answer's length when the request gives none (vLLM's completions: 16; its chats: None, the
        rest of the context)."""
        other = sorted(k for k, v in params.items() if k not in REPRODUCED and v is not None and not (k in NO_OPS and v == NO_OPS[k]))
        if other:
            return f"vLLM samples with {other}"
        if params.get("stop"):
            return "stop strings are matched by vLLM"
        if float(defaults.get("repetition_penalty") or 1.0) != 1.0:
            return "the checkpoint's generation_config sets a repetition penalty"
        merged = {**{k: v for k, v in defaults.items() if k in GENERATION_KEYS}, **{k: v for k, v in params.items() if v is not None}}
        for key, kind in KINDS.items():
            if key in merged and not _number(merged[key], kind):
                return f"{key}={merged[key]!r} is vLLM's to judge"
        stop_ids = merged.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(type(t) is int for t in stop_ids):
            return f"stop_token_ids={stop_ids!r} is vLLM's to judge"
        max_tokens = merged.get("max_completion_tokens", merged.get("max_tokens", default_max_tokens))
        ends = set(stop_ids) | set(_ids(defaults.get("eos_token_id"))) - {eos_id}  # the config's other end ids stop even with ignore_eos
        if eos_id is not None and not merged.get("ignore_eos"):
            ends.add(eos_id)
        first = cls(float(merged.get("temperature", 1.0)), float(merged.get("top_p", 1.0)), int(merged.get("top_k", 0)), float(merged.get("min_p", 0.0)),
                    merged.get("seed"), max_tokens, frozenset(ends), bool(merged.get("return_token_ids")),
                    {k: v for k, v in defaults.items() if k in GENERATION_KEYS and params.get(k) is None})  # fmt: skip
        if first.temperature < 0 or not 0 < first.top_p <= 1 or first.top_k < -1 or not 0 <= first.min_p <= 1 or (max_tokens is not None and max_tokens < 1):
            return "a sampling value out of range is vLLM's to judge"
        return first

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def sample(self, logits: torch.Tensor) -> int:
        """One token from the last prompt token's logits: greedy, or temperature, min-p, top-k and
        top-p in vLLM's order, seeded by ``seed`` when given."""
        if self.greedy:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.min_p > 0:
            probs = torch.where(probs >= self.min_p * probs.max(), probs, 0.0)
        probs, order = probs.sort(descending=True)
        if self.top_k > 0:
            probs[self.top_k :] = 0.0
        if self.top_p < 1:
            before = probs.cumsum(0) - probs  # mass of the more likely tokens: keep while it is below top_p
            probs = torch.where(before < self.top_p * probs.sum(), probs, 0.0)
        generator = torch.Generator().manual_seed(self.seed) if self.seed is not None else None
        return int(order[torch.multinomial(probs, 1, generator=generator)])

    def finish(self, token: int) -> str | None:
        """Why the answer ends at its first token (OpenAI's ``finish_reason``), or None."""
        if token in self.stop_ids:
            return "stop"
        return "length" if self.max_tokens == 1 else None

    def forwarded(self, params: dict[str, Any], *, echoed: bool = False) -> dict[str, Any]:
        """The parameters for the decode server, which generates from the second token on (``echoed``:
        from the first, which it makes the tier's, ``kv.vllm_first_token``): the checkpoint's generation
        defaults explicit (vLLM's generate endpoint does not apply them) and ``max_tokens`` one less
        (``echoed``: the answer's)."""
        rest = {**{k: v for k, v in params.items() if k != "max_completion_tokens"}, **self.defaults}
        if self.max_tokens is not None:
            rest["max_tokens"] = self.max_tokens - (not echoed)
        return rest


def _ids(value: Any) -> list[int]:
    return [value] if type(value) is int else [v for v in value or [] if type(v) is int]


def token_text(tokenizer, prompt: list[int], token: int) -> str | None:
    """The text ``token`` adds after ``prompt``, as vLLM's incremental detokenizer gives it (special
    tokens skipped), or None when it is not whole on its own (an incomplete multi-byte character)."""
    tail = prompt[-6:]
    before = tokenizer.decode(tail, skip_special_tokens=True)
    after = tokenizer.decode(tail + [token], skip_special_tokens=True)
    if not after.startswith(before) or after.endswith("\ufffd"):
        return None
    return after[len(before) :]


def first_chunk(answer_id: str, model: str, created: int, text: str, token: int, finish: str | None,
                prompt: list[int] | None) -> dict[str, Any]:  # fmt: skip
    """The completion chunk of the first token (``prompt``: its ids, when the client asked for token ids)."""
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    if prompt is not None:
        choice.update(prompt_token_ids=prompt, token_ids=[token])
    return {"id": answer_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip


def shift(answer: dict[str, Any], answer_id: str, first: dict[str, Any] | None = None) -> dict[str, Any]:
    """A decode server's completion or chunk, generated after the tier's first token, as the client's:
    our id; usage counting that token as generated, not as prompt; for a whole answer (``first``: the
    first token's chunk) its text and token ids in front; vLLM's prompt ids (the prompt and our token)
    dropped, the first chunk had the prompt's."""
    out = {**answer, "id": answer_id}
    if isinstance(answer.get("usage"), dict):
        u = answer["usage"]
        out["usage"] = {**u, "prompt_tokens": u["prompt_tokens"] - 1, "completion_tokens": u["completion_tokens"] + 1}
    choices = []
    for choice in answer.get("choices", []):
        choice = {k: v for k, v in choice.items() if k != "prompt_token_ids"}
        if first is not None:
            head = first["choices"][0]
            choice["text"] = head["text"] + choice.get("text", "")
            if "token_ids" in head:
                choice.update(prompt_token_ids=head["prompt_token_ids"], token_ids=head["token_ids"] + (choice.get("token_ids") or []))
        choices.append(choice)
    out["choices"] = choices
    return out
