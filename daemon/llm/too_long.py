"""Whether a provider refused a request for its length (CONTRACT §15, §14.1), in the
words each real server uses — one table, `OVERFLOW`, each row a server and what it
says (lowercased), each with its test (tests/test_overflow_words.py).

A refusal counts in an HTTP error of 400, 413 or 422 (and 500, which Ollama answered
with before it said 400), or in an error event / error object with no status of its
own, before the first delta. A refusal for length is never retried as transient (the
same request would be refused again): it is compacted and sent once more.
"""

from __future__ import annotations

import re

from daemon.errors import ProviderError

# (who says it, the pattern over the lowercased message). Each pattern is taken from
# the server's own source or a capture of it; the examples are in the tests.
OVERFLOW: tuple[tuple[str, re.Pattern[str]], ...] = (
    # OpenAI: {"error": {"code": "context_length_exceeded", "message": "This model's
    # maximum context length is 8192 tokens. However, your messages resulted in …"}}
    ("openai", re.compile(r"context_length_exceeded")),
    # OpenAI, vLLM ("This model's maximum context length is 4096 tokens. However, you
    # requested 5000 tokens …"; newer: "… and your request has 3500 input tokens"),
    # llama-cpp-python (its server rewrites llama_cpp's ValueError into OpenAI's words)
    ("openai, vllm, llama-cpp-python", re.compile(r"maximum context length")),
    # vLLM's input processor: "The decoder prompt (length 5951) is longer than the
    # maximum model length of 4096."
    ("vllm", re.compile(r"longer than the maximum model length")),
    # llama.cpp's llama-server: {"error": {"type": "exceed_context_size_error",
    # "message": "request (4476 tokens) exceeds the available context size (4096
    # tokens), try increasing it"}}; older: "the request exceeds the available context
    # size, try increasing it"
    ("llama.cpp", re.compile(r"exceed_context_size_error"
                             r"|exceeds the available context size")),
    # llama-cpp-python's llama_cpp (its own ValueError, where its server does not
    # rewrite it): "Requested tokens (2100) exceed context window of 2048"
    ("llama-cpp-python", re.compile(r"requested tokens \(\d+\) exceed context window")),
    # Ollama: "the input length exceeds the context length"
    ("ollama", re.compile(r"input length exceeds the context length")),
    # Anthropic Messages: "prompt is too long: 208310 tokens > 200000 maximum"; and
    # "input length and `max_tokens` exceed context limit: 188240 + 21333 > 200000"
    ("anthropic", re.compile(r"prompt is too long|exceed context limit")),
    # OpenAI Responses and others: "Your input exceeds the context window of this model"
    ("others", re.compile(r"exceeds the context window|context window exceeded"
                          r"|context length exceeded|exceeds the context length")),
)

REFUSING_STATUSES = (400, 413, 422, 500, None)


def overflow_source(message: str) -> str | None:
    """Which row of OVERFLOW `message` matches (its server), else None."""
    text = message.lower()
    for who, pattern in OVERFLOW:
        if pattern.search(text):
            return who
    return None


def refused_for_length(exc: ProviderError) -> bool:
    if exc.status not in REFUSING_STATUSES:
        return False
    if exc.status is None and exc.reason not in ("error_event", None):
        return False
    return overflow_source(exc.message) is not None
