"""runtime/turnrow.py: the one shape a turn's row keeps a /v1 client's offer in
(CONTRACT §17.1, §18), both ways, and its bound."""

from __future__ import annotations

import json

import pytest

from daemon.runtime.turnrow import OFFER_MAX_BYTES, OfferNotKept, asked, offer_json, offer_of
from daemon.store.models import MessageRecord
from daemon.tools.client import ClientOffer, ClientTool

WEATHER = ClientTool("get_weather", "the weather", {"type": "object", "properties": {
    "city": {"type": "string"}}})


def test_an_offer_round_trips() -> None:
    offer = ClientOffer((WEATHER,), {"tool_choice": "required", "parallel_tool_calls": False,
                                     "response_format": {"type": "json_object"}})
    client, cap = offer_of(offer_json(offer, 77))
    assert client is not None and cap == 77
    assert [(t.name, t.description, t.parameters) for t in client.tools] == [
        (WEATHER.name, WEATHER.description, WEATHER.parameters)]
    assert client.options == offer.options


def test_nothing_to_keep_is_none() -> None:
    assert offer_json(None, None) is None and offer_json(ClientOffer(), None) is None
    assert offer_of(None) == (None, None)
    assert offer_of(offer_json(None, 12)) == (None, 12)


def test_an_offer_over_the_bound_is_not_kept_and_says_so() -> None:
    big = ClientTool("big", "x" * OFFER_MAX_BYTES, {})
    text = offer_json(ClientOffer((big,)), None)
    assert text is not None and len(text) < 100
    with pytest.raises(OfferNotKept, match="were over the 1048576 bytes"):
        offer_of(text)
    assert json.loads(text)["tooLarge"] > OFFER_MAX_BYTES


def test_what_a_stored_turn_was_asked() -> None:
    user = MessageRecord("user", "hello", None, None, 1)
    answer = MessageRecord("assistant", "hi", None, None, 2)
    r1 = MessageRecord("tool", "sunny", None, "call_1", 1)
    r2 = MessageRecord("tool", "21C", None, "call_2", 1)
    assert asked([user, answer]) == "hello"
    assert asked([r1, r2, answer]) == "[result of call_1]\nsunny\n\n[result of call_2]\n21C"
    assert asked([]) is None and asked([answer]) is None
