"""The daemon serves the health route and a scripted JSON chat end to end."""

from tests.harness import Running, mock


async def test_health_and_chat(daemon: Running) -> None:
    r = await daemon.http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = await daemon.chat(mock(say="hello there"))
    assert r.status_code == 200, r.text
    assert r.json()["content"] == "hello there"
