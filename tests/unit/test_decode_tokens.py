"""``cluster.decode_tokens``: the generate endpoint's request made from the tier's forward, and the
text of its token ids made here as vLLM makes it (a ``DecodeStream`` primed with the whole prompt),
on a byte-level BPE tokenizer whose characters of several bytes split across tokens. (Against a real
vLLM server, through the tier: ``tests/ray/test_openai_endpoint.py``.)"""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from cluster.decode_tokens import TokenText, generate_body

EOS = 1
TEXT = ["naïve café 日本語のテキスト 🙂🚀 ÷ ü ß ñ", "plain words and more words", "Ελληνικά κείμενα και русский текст", "emoji 🎉🎉 again 日本"]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE of a few hundred tokens: most characters of several bytes stay split."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(TEXT * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


def vllms_text(tokenizer, prompt, generated):
    """vLLM 0.26's detokenizer: a stream primed with the whole prompt, stepped through each token."""
    stream = DecodeStream(ids=prompt, skip_special_tokens=True)
    return "".join(stream.step(tokenizer._tokenizer, t) or "" for t in generated)


def test_the_text_equals_vllms_whatever_splits_the_characters(tokenizer):
    """Answers cut at every kind of place (inside a character of 2, 3 and 4 bytes) after prompts that
    end on a whole character (the tier's prompt and first token always do: ``first_token.token_text``):
    the text made from the prompt's tail is vLLM's, chunk by chunk as the ids come."""
    ids = tokenizer.encode(" ".join(TEXT * 3))
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # characters do split
    whole = [cut for cut in range(1, len(ids) - 40) if not tokenizer.decode(ids[:cut]).endswith("\ufffd")]
    rng = random.Random(0)
    for _ in range(200):
        cut, n = rng.choice(whole), rng.randrange(1, 40)
        prompt, generated = ids[:cut], ids[cut : cut + n]
        text = TokenText(tokenizer, prompt, EOS, ignore_eos=False, token_ids=True, model="m")
        pieces, i = [], 0
        while i < n:
            step = rng.randrange(1, 4)
            chunk = text.chunk({"request_id": "r", "choices": [{"index": 0, "token_ids": generated[i : i + step], "finish_reason": None}]})
            assert chunk["choices"][0]["token_ids"] == generated[i : i + step]
            pieces.append(chunk["choices"][0]["text"])
            i += step
        assert "".join(pieces) == vllms_text(tokenizer, prompt, generated), (cut, n)


def test_only_a_tokenizer_with_the_rust_backend_is_taken(tokenizer):
    assert TokenText.supports(tokenizer)
    assert not TokenText.supports(object())  # a slow tokenizer (no backend): its answers stay vLLM's completions


def test_a_stop_token_is_counted_not_written_and_named_unless_it_is_the_end_of_sequence(tokenizer):
    ids = tokenizer.encode("plain words and more words")
    word = ids[3]

    def last(token, ignore_eos=False, finish="stop"):
        text = TokenText(tokenizer, ids[:3], EOS, ignore_eos=ignore_eos, token_ids=False, model="m")
        return text.chunk({"request_id": "r", "choices": [{"index": 0, "token_ids": [ids[4], token], "finish_reason": finish}]})["choices"][0]

    eos = last(EOS)
    assert (eos["text"], eos["finish_reason"], eos["stop_reason"]) == (vllms_text(tokenizer, ids[:3], [ids[4]]), "stop", None)
    assert "token_ids" not in eos
    stopped = last(word)  # a stop_token_ids id: left out of the text as vLLM leaves it, and named
    assert (stopped["text"], stopped["stop_reason"]) == (vllms_text(tokenizer, ids[:3], [ids[4]]), word)
    assert last(EOS, ignore_eos=True)["stop_reason"] == EOS  # the end of sequence in stop_token_ids with ignore_eos
    long = last(word, finish="length")
    assert (long["text"], long["stop_reason"]) == (vllms_text(tokenizer, ids[:3], [ids[4], word]), None)


def test_usage_and_errors_pass_and_a_whole_answer_is_a_completions(tokenizer):
    ids = tokenizer.encode("plain words and more words")
    text = TokenText(tokenizer, ids[:2], EOS, ignore_eos=False, token_ids=True, model="m")
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert text.chunk({"request_id": "r", "choices": [], "usage": usage}) == {"id": "r", "object": "text_completion", "created": text.created,
                                                                             "model": "m", "choices": [], "usage": usage}  # fmt: skip
    error = {"error": {"message": "bad", "code": 400}}
    assert text.chunk(error) is error
    whole = TokenText(tokenizer, ids[:2], EOS, ignore_eos=False, token_ids=False, model="m").whole(
        {"request_id": "r", "choices": [{"index": 0, "token_ids": ids[2:5], "finish_reason": "length"}], "usage": usage})
    assert whole["choices"] == [{"index": 0, "text": vllms_text(tokenizer, ids[:2], ids[2:5]), "logprobs": None, "finish_reason": "length",
                                 "stop_reason": None, "prompt_logprobs": None}]  # fmt: skip
    assert whole["usage"] == usage


def test_the_generate_request_carries_every_parameter_or_refuses():
    forward = {"model": "m", "prompt": [3, 4], "stream": True, "stream_options": {"include_usage": False}, "kv_transfer_params": {"mlapool": {}},
               "max_tokens": 7, "temperature": 0.6, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3, "stop_token_ids": [9], "ignore_eos": True,
               "return_token_ids": True, "user": "u", "stop": [], "logprobs": None}  # fmt: skip
    body = generate_body(forward)
    assert body == {"model": "m", "token_ids": [3, 4], "stream": True, "stream_options": {"include_usage": False},
                    "sampling_params": {"max_tokens": 7, "temperature": 0.6, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3, "stop_token_ids": [9],
                                        "ignore_eos": True, "detokenize": False, "extra_args": {"kv_transfer_params": {"mlapool": {}}}}}  # fmt: skip
    with pytest.raises(ValueError, match=r"\['logit_bias'\]"):
        generate_body({**forward, "logit_bias": {"3": 1}})
    with pytest.raises(ValueError, match=r"\['stop'\]"):
        generate_body({**forward, "stop": ["w"]})
