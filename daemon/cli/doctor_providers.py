"""`veild doctor`'s look at a Chat Completions provider (CONTRACT §14.1): does
`{base_url}/models` answer (a 404 where `{base_url}/v1/models` answers names the URL
that was meant), and what window does the server say it has — llama.cpp's `/props`
(`default_generation_settings.n_ctx`, per slot), else `/v1/models` (vLLM's
`max_model_len`, llama.cpp's `meta.n_ctx_train`). An agent whose `context_tokens` is
larger than its provider's window is warned about: veild would not compact before the
server refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from daemon.config import AgentConfig, ProviderConfig

TIMEOUT_S = 3.0


class Passed(str):
    """What a check that passed has to say (`ok: …`)."""


class Warned(str):
    """A check that did not fail but wants a look (`WARNING: …`)."""


class Unknown(str):
    """A check with nothing to say: no line."""


@dataclass(frozen=True)
class Window:
    """A server's context window as it says it: `tokens`, and where it said so."""

    tokens: int
    source: str


@dataclass
class ProviderWindows:
    """What each provider's server said of its window: for the server (key None) or
    per model id."""

    seen: dict[str, dict[str | None, Window]]

    def of(self, agent: AgentConfig) -> tuple[str, Window] | None:
        """(provider name, window) for `agent`, when its provider told it."""
        if agent.provider is None:
            return None
        windows = self.seen.get(agent.provider) or {}
        window = windows.get(agent.model) or windows.get(None)
        if window is None and len(windows) == 1:
            window = next(iter(windows.values()))  # a server with one model
        return (agent.provider, window) if window is not None else None


def _get(client: httpx.Client, url: str) -> httpx.Response | None:
    try:
        return client.get(url)
    except httpx.HTTPError:
        return None


def _json(r: httpx.Response | None) -> Any:
    if r is None or r.status_code != 200:
        return None
    try:
        return r.json()
    except ValueError:
        return None


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


def _model_windows(listing: Any, url: str) -> dict[str | None, Window]:
    """Each model's window from a `/v1/models` answer (vLLM, llama.cpp), if it says."""
    found: dict[str | None, Window] = {}
    data = listing.get("data") if isinstance(listing, dict) else None
    for model in data if isinstance(data, list) else []:
        if not isinstance(model, dict) or not isinstance(model.get("id"), str):
            continue
        meta = model.get("meta") if isinstance(model.get("meta"), dict) else {}
        tokens = _positive(model.get("max_model_len")) or _positive(
            (meta or {}).get("n_ctx_train"))
        if tokens is not None:
            key = "max_model_len" if _positive(model.get("max_model_len")) else "n_ctx_train"
            found[model["id"]] = Window(tokens, f"{url} {key}")
    return found


def _props_window(client: httpx.Client, root: str) -> Window | None:
    """llama.cpp's `GET /props`: the window of one slot."""
    url = f"{root}/props"
    props = _json(_get(client, url))
    settings = props.get("default_generation_settings") if isinstance(props, dict) else None
    tokens = _positive(settings.get("n_ctx")) if isinstance(settings, dict) else None
    return Window(tokens, f"{url} n_ctx") if tokens is not None else None


def provider_check(p: ProviderConfig, windows: ProviderWindows) -> str | None:
    """None or Passed when the server answers as a Chat Completions root; else why not.
    What it says of its window goes into `windows`."""
    base = p.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {p.api_key}"} if p.api_key else {}
    with httpx.Client(headers=headers, timeout=TIMEOUT_S, verify=p.ca_file or True,
                      follow_redirects=False) as client:
        url = f"{base}/models"
        r = _get(client, url)
        if r is None:
            return f"GET {url} failed (is base_url the server's OpenAI root?)"
        if r.status_code == 404:
            if not base.endswith("/v1") and _json(_get(client, f"{base}/v1/models")) \
                    is not None:
                return (f"GET {url} answers 404, {base}/v1/models answers: did you mean "
                        f"{base}/v1? (base_url is the server's OpenAI root, ending in /v1)")
            return Passed(f"GET {url} answers 404: no model list, its window unknown")
        if r.status_code in (401, 403):
            key = f"${p.api_key_env}" if p.api_key_env else "no api_key_env"
            return f"GET {url} answers {r.status_code}: the server refused the key ({key})"
        if r.status_code != 200:
            return Passed(f"GET {url} answers {r.status_code}: its window unknown")
        found = _model_windows(_json(r), url)
        server = _props_window(client, base.removesuffix("/v1"))
        if server is not None:
            found = {None: server}  # what the server runs with, not what it was trained on
        windows.seen[p.name] = found
    if not found:
        return Passed("the server does not say its window: set each agent's "
                      "context_tokens to it (docs/providers.md)")
    sizes = sorted({w.tokens for w in found.values()})
    return Passed(f"window {', '.join(map(str, sizes))} tokens "
                  f"({next(iter(found.values())).source})")


def window_check(agent: AgentConfig, windows: ProviderWindows) -> str | None:
    """Passed when the agent's `context_tokens` fits its provider's window, a Warned
    when it is larger, Unknown when the window is not known."""
    known = windows.of(agent)
    if known is None:
        return Unknown()
    provider, window = known
    if agent.context_tokens > window.tokens:
        return Warned(f"context_tokens = {agent.context_tokens} is larger than the window "
                      f"{window.tokens} provider {provider} says it has ({window.source}): "
                      f"veild would not compact before the server refuses; set "
                      f"context_tokens = {window.tokens}")
    return Passed(f"context_tokens = {agent.context_tokens} fits the window "
                  f"{window.tokens} of provider {provider}")
