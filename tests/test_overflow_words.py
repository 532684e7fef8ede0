"""CONTRACT §14.1 / §15: a refusal for length is recognised in each real server's own
words — one example per row of daemon.llm.too_long.OVERFLOW, as the server sends it
(from its source or a capture) — and nothing else is taken for one: a rate limit that
speaks of tokens, a 401, an error after the answer began."""

from __future__ import annotations

import pytest

from daemon.errors import ProviderError
from daemon.llm.too_long import OVERFLOW, overflow_source, refused_for_length

# (the row it must match, status, the message as ProviderError carries it)
SAID: list[tuple[str, int | None, str]] = [
    ("openai", 400, 'provider answered HTTP 400: {"error": {"message": "This model\'s '
     'maximum context length is 8192 tokens. However, your messages resulted in 9000 '
     'tokens.", "type": "invalid_request_error", "param": "messages", "code": '
     '"context_length_exceeded"}}'),
    ("openai, vllm, llama-cpp-python", 400, 'provider answered HTTP 400: {"object": '
     '"error", "message": "This model\'s maximum context length is 2048 tokens. However, '
     'you requested 2100 tokens (2000 in the messages, 100 in the completion). Please '
     'reduce the length of the messages or completion.", "type": "BadRequestError"}'),
    ("vllm", 400, 'provider answered HTTP 400: {"error": {"message": "The decoder prompt '
     '(length 5951) is longer than the maximum model length of 4096. Make sure that '
     '`max_model_len` is no smaller than the number of text tokens."}}'),
    ("llama.cpp", 400, 'provider answered HTTP 400: {"error":{"code":400,"message":'
     '"request (4476 tokens) exceeds the available context size (4096 tokens), try '
     'increasing it","type":"exceed_context_size_error","n_prompt_tokens":4476,'
     '"n_ctx":4096}}'),
    ("llama.cpp", 400, 'provider answered HTTP 400: {"error":{"code":400,"message":'
     '"the request exceeds the available context size, try increasing it"}}'),
    ("llama-cpp-python", 500, 'provider answered HTTP 500: {"error": {"message": '
     '"Requested tokens (2100) exceed context window of 2048"}}'),
    ("ollama", 400, 'provider answered HTTP 400: {"error":{"message":"the input length '
     'exceeds the context length","type":"invalid_request_error","param":null,'
     '"code":null}}'),
    ("ollama", 500, 'provider answered HTTP 500: {"error":"the input length exceeds the '
     'context length"}'),
    ("anthropic", 400, 'provider answered HTTP 400: {"type": "error", "error": {"type": '
     '"invalid_request_error", "message": "prompt is too long: 208310 tokens > 200000 '
     'maximum"}}'),
    ("anthropic", 400, 'provider answered HTTP 400: {"type": "error", "error": {"type": '
     '"invalid_request_error", "message": "input length and `max_tokens` exceed context '
     'limit: 188240 + 21333 > 200000, decrease input length or `max_tokens` and try '
     'again"}}'),
    ("others", 400, 'provider answered HTTP 400: {"error": {"message": "Your input '
     'exceeds the context window of this model. Please adjust your input and try '
     'again.", "code": "context_length_exceeded"}}'),
]


def test_every_row_has_an_example() -> None:
    assert {who for who, _ in OVERFLOW} == {who for who, _, _ in SAID}


@pytest.mark.parametrize(("who", "status", "message"), SAID,
                         ids=[f"{who}-{i}" for i, (who, _, _) in enumerate(SAID)])
def test_each_servers_words_are_a_refusal_for_length(who: str, status: int | None,
                                                     message: str) -> None:
    if who != "others":  # the catch-all row comes last: an earlier row may say it first
        assert overflow_source(message) == who
    assert refused_for_length(ProviderError(message, status=status))


def test_in_an_error_event_or_object_before_any_delta() -> None:
    said = ("provider answered with an error: exceed_context_size_error: request (600 "
            "tokens) exceeds the available context size (512 tokens), try increasing it")
    assert refused_for_length(ProviderError(said, reason="error_event"))


@pytest.mark.parametrize(("status", "reason", "message"), [
    (429, None, "Rate limit reached: too many tokens per minute, maximum context length"),
    (401, None, "invalid key; maximum context length is irrelevant"),
    (400, None, "messages: content must be a string"),
    (None, "dropped", "provider closed: maximum context length"),
    (503, None, "the input length exceeds the context length"),
])
def test_what_is_not_a_refusal_for_length(status: int | None, reason: str | None,
                                          message: str) -> None:
    assert not refused_for_length(ProviderError(message, status=status, reason=reason))
