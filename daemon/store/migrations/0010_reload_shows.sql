-- veild schema 10: what a reload must show that the live view showed (issue 44, item 5).
-- A message taken from a session's inbox says so, and from which session (NULL: from
-- outside) — what its live `message` event said (`delivered`, `fromSessionId`), so a
-- delivery's header is shown from what the daemon stored, never from the text. A
-- turn's notes — its `turn.queued`/`turn.admitted` and `provider.retry` events, each
-- with when and after how many of the turn's messages it came (JSON, written with the
-- turn's end) — so its queued and retry notes are drawn again where they were.
ALTER TABLE messages ADD COLUMN delivered INTEGER NOT NULL DEFAULT 0;
ALTER TABLE messages ADD COLUMN from_session_id TEXT;
ALTER TABLE turns ADD COLUMN notes TEXT;
