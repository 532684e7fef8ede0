"""What a turn's row keeps of its ask besides the columns of its own (CONTRACT §18): a
/v1 client's offer — its tools, its request fields (§17.1) and its output cap (§14.1) —
as one JSON text, so that a run resumed after a restart offers the model what the first
run did. One place for that shape, both ways. And what a turn that starts from a
client's tool results says it was asked, when it starts and when it is resumed.

Bounded: an offer over OFFER_MAX_BYTES is not kept whole; the row says so (`tooLarge`),
and such a turn is not resumed (it ends INTERRUPTED, saying why) rather than resumed
with tools missing. A request body is at most 1 MiB (api/app.py), so only a body that
is nearly all tools comes near it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from daemon.store.models import MessageRecord
from daemon.tools.client import ClientOffer, ClientTool

OFFER_MAX_BYTES = 1024 * 1024


class OfferNotKept(ValueError):
    """The row's offer was too large to keep: the turn cannot be resumed as it ran."""


def offer_json(client: ClientOffer | None, output_cap: int | None) -> str | None:
    """The row's `client_offer`: None when the turn had neither."""
    if not client and output_cap is None:
        return None
    shape: dict[str, Any] = {}
    if client is not None:
        shape["tools"] = [{"name": t.name, "description": t.description,
                           "parameters": t.parameters} for t in client.tools]
        shape["options"] = dict(client.options)
    if output_cap is not None:
        shape["outputCap"] = output_cap
    text = json.dumps(shape, separators=(",", ":"))
    if len(text.encode()) > OFFER_MAX_BYTES:
        return json.dumps({"tooLarge": len(text.encode())})
    return text


def offer_of(text: str | None) -> tuple[ClientOffer | None, int | None]:
    """The offer and output cap a row kept (`offer_json`'s inverse); OfferNotKept when
    it was too large to keep."""
    if not text:
        return None, None
    shape = json.loads(text)
    if "tooLarge" in shape:
        raise OfferNotKept(f"its client's tools and request fields ({shape['tooLarge']} "
                           f"bytes) were over the {OFFER_MAX_BYTES} bytes a turn keeps")
    tools = tuple(ClientTool(t["name"], t.get("description") or "", t.get("parameters") or {})
                  for t in shape.get("tools") or ())
    options = shape.get("options") or {}
    client = ClientOffer(tools, options) if tools or options else None
    cap = shape.get("outputCap")
    return client, int(cap) if cap is not None else None


def results_text(results: Sequence[MessageRecord]) -> str:
    """What a turn that starts from tool results says it was asked (chat.user_message)."""
    return "\n\n".join(f"[result of {m.tool_call_id}]\n{m.content}" for m in results)


def asked(mine: Sequence[MessageRecord]) -> str | None:
    """What a stored turn was asked, from its own stored messages (CONTRACT §18): its
    user message, or the client's tool results it started from (§17.1); None when
    neither was stored."""
    if not mine:
        return None
    if mine[0].role == "user":
        return mine[0].content
    results = []
    for m in mine:
        if m.role != "tool":
            break
        results.append(m)
    return results_text(results) if results else None
