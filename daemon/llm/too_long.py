"""Whether a provider refused a request for its length (CONTRACT §15): Chat Completions'
`context_length_exceeded` or a 400 naming the maximum context length, the Messages API's
`prompt is too long` — in an HTTP error or an error event before the first delta."""

from __future__ import annotations

import re

from daemon.errors import ProviderError

# What the APIs (and the servers that imitate them: vLLM, llama.cpp, Ollama, LiteLLM)
# say, lowercased.
_SAYS = re.compile(
    r"context_length_exceeded|maximum context length|prompt is too long"
    r"|context length|context window|too many tokens|exceeds the context")


def refused_for_length(exc: ProviderError) -> bool:
    if exc.status not in (400, 413, None):
        return False
    if exc.status is None and exc.reason not in ("error_event", None):
        return False
    return _SAYS.search(exc.message.lower()) is not None
