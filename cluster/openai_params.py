"""Every parameter a client can send to the tier's ``/v1/completions`` and ``/v1/chat/completions``,
and what the tier does with it. None is dropped silently: each is read by the tier, forwarded to the
vLLM decode server (which applies it as it decodes), or refused with a 400 that names it and says why.

The tier prefills the prompt itself and sends vLLM a completion of token ids with the prompt's KV, so
what acts on the prompt (its tokenization, a chat's template) is the tier's to apply, and what needs
the prompt computed by vLLM (its log-probabilities, its truncation, several samples of one prompt)
cannot be had. A chat reaches vLLM as a completion: its sampling parameters carry over, and what only
vLLM's chat server does (tool calls and reasoning parsed out of the text, chat-shaped log-probabilities)
is refused rather than answered wrongly. Parameters of OpenAI's own service that no open server has
(stored completions, audio, predicted outputs, web search) are refused unless given their off value.
A name in none of the lists is refused as unknown (OpenAI's API does the same; vLLM's server would
ignore it with a warning in its log).
"""

from __future__ import annotations

from typing import Any

# read by the tier itself (``cluster.openai_api.parse_request`` and the endpoint)
OWN = frozenset({"model", "prompt", "messages", "stream", "stream_options", "n", "echo", "kv_transfer_params"})

# applied by the tier when it turns the request into token ids (``Tokenizer.encode``)
TOKENIZATION = frozenset({"add_special_tokens"})
CHAT_TEMPLATE = frozenset({"chat_template_kwargs", "add_generation_prompt", "continue_final_message", "documents"})

# forwarded to the decode server's /v1/completions: vLLM applies them to what it generates
FORWARDED = frozenset({
    # OpenAI's
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "presence_penalty", "frequency_penalty", "seed",
    "logit_bias", "user", "response_format", "logprobs",
    # vLLM's sampling and output extras
    "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids", "bad_words", "structured_outputs",
    "priority", "request_id", "return_token_ids", "return_tokens_as_token_ids", "return_token_offsets", "stream_interval",
    "thinking_token_budget", "vllm_xargs", "cache_salt",
})  # fmt: skip

PROMPT_HERE = "the prompt is prefilled by this tier, not by the decode server"
REFUSED = {
    "suffix": "suffix is not supported (vLLM's completions refuse it too)",
    "chat_template": "a chat template from the request is not taken (as vLLM without --trust-request-chat-template): the checkpoint's is used",
    "best_of": "best_of must be 1: one prompt's prefilled KV is loaded once",
    "use_beam_search": "beam search is not supported: one prompt's prefilled KV is loaded once",
    "prompt_logprobs": f"prompt_logprobs is not supported: {PROMPT_HERE}, so no prompt log-probabilities are computed",
    "truncate_prompt_tokens": f"truncate_prompt_tokens is not supported: {PROMPT_HERE}, whole; send the prompt you want prefilled",
    "truncation_side": f"truncation_side is not supported: {PROMPT_HERE}, whole",
    "prompt_embeds": "prompt_embeds is not supported: the prompt must be text or token ids",
    "routed_experts_prompt_start": f"routed_experts_prompt_start is not supported: {PROMPT_HERE}",
    "session_id": "session_id is not supported by this tier",
    "repetition_detection": "repetition_detection is not supported by this tier yet (a vLLM 0.32 parameter; the tier takes vLLM 0.26's)",
    "watermarking": "watermarking is not supported by this tier yet (a vLLM 0.32 parameter; the tier takes vLLM 0.26's)",
    "logprob_token_ids": "logprob_token_ids is not supported by this tier yet (a vLLM 0.32 parameter; the tier takes vLLM 0.26's)",
    "ec_transfer_params": "ec_transfer_params is not supported by this tier",
    "mm_payload": "multimodal inputs are not supported: this tier serves text",
    "return_mm_kwargs": "multimodal inputs are not supported: this tier serves text",
    "mm_processor_kwargs": "multimodal inputs are not supported: this tier serves text",
    "media_io_kwargs": "multimodal inputs are not supported: this tier serves text",
    "tools": "tool calling is not supported through this tier (vLLM gets the chat as a completion, with no tool parser)",
    "functions": "function calling is not supported through this tier (vLLM gets the chat as a completion, with no tool parser)",
    "function_call": "function calling is not supported through this tier (vLLM gets the chat as a completion, with no tool parser)",
    "parallel_tool_calls": "tool calling is not supported through this tier",
    "reasoning_effort": "reasoning_effort is not supported through this tier (no reasoning parser: vLLM gets the chat as a completion)",
    "include_reasoning": "include_reasoning is not supported through this tier (no reasoning parser: vLLM gets the chat as a completion)",
    "return_prompt_text": "return_prompt_text is not supported through this tier",
    "audio": "audio output is not supported: this tier serves text",
    "prediction": "predicted outputs are not supported by this tier",
    "web_search_options": "web search is not supported by this tier",
    "metadata": "metadata is for stored completions, which this tier does not keep",
}
# accepted with their off value only: (the value that is a no-op here, why another is refused)
OFF_ONLY = {
    "tool_choice": ("none", "tool calling is not supported through this tier"),
    "store": (False, "stored completions are not supported by this tier"),
    "modalities": (["text"], "only text output is supported by this tier"),
    "service_tier": ("auto", "service tiers are not supported by this tier"),
}
# in a chat, OpenAI's log-probabilities (a flag and top_logprobs) take another form than a completion's
CHAT_REFUSED = {
    "logprobs": "logprobs in a chat is not supported through this tier (vLLM answers it as a completion); use /v1/completions with logprobs",
    "top_logprobs": "top_logprobs in a chat is not supported through this tier; use /v1/completions with logprobs",
}


def taken(chat: bool) -> frozenset[str]:
    """The names an endpoint takes: its own, the tokenization's, a chat's template's, the forwarded,
    and those taken with their off value."""
    if chat:
        return (OWN - {"prompt"}) | TOKENIZATION | CHAT_TEMPLATE | (FORWARDED - {"logprobs"}) | frozenset(OFF_ONLY) | frozenset(CHAT_REFUSED)
    return (OWN - {"messages"}) | TOKENIZATION | (FORWARDED - {"max_completion_tokens"}) | frozenset(OFF_ONLY)


def forwarded(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The parameters for the decode server (a request that passed :func:`refusal`)."""
    return {name: value for name, value in body.items() if name in FORWARDED and not (chat and name in CHAT_REFUSED)}


def refusal(body: dict[str, Any], chat: bool) -> str | None:
    """Why the request's parameters are refused (the first reason), or None."""
    for name, value in body.items():
        if chat and name in CHAT_REFUSED and not _off(value):
            return f"{name}: {CHAT_REFUSED[name]}"
        if name in REFUSED and not _off(value) and not (name == "best_of" and value == 1):
            return f"{name}: {REFUSED[name]}"
        if name in OFF_ONLY and value is not None and value != OFF_ONLY[name][0]:
            off, why = OFF_ONLY[name]
            return f"{name} {value!r}: {why} (only {off!r} is taken)"
    unknown = sorted(set(body) - taken(chat) - set(REFUSED))
    if unknown:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return f"unknown parameter(s) {unknown} for {path}; the parameters taken are listed in docs/vllm-decode.md"
    return None


def _off(value: Any) -> bool:
    """Absent in effect: null, false or empty (0 is a value: ``prompt_logprobs`` 0 asks for some)."""
    return value is None or value is False or (isinstance(value, (str, list, dict)) and not value)
