-- veild schema: what a turn carries besides its messages, kept so that a resume after a
-- restart (CONTRACT §18) and a wake go on as the first run would have. `traceparent`
-- (W3C, §12.1 v4): the span a turn's span descends from, so its resumed run stays in
-- the caller's trace; on an inbox entry, the span that delivered it, which the wake
-- that drains it continues. `client_offer` (JSON, bounded: runtime/turnrow.py): a /v1
-- client's tools and request fields for the turn (§17.1), offered again on resume.
ALTER TABLE turns ADD COLUMN traceparent TEXT;
ALTER TABLE turns ADD COLUMN client_offer TEXT;
ALTER TABLE inbox ADD COLUMN traceparent TEXT;
