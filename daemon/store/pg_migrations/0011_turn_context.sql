-- veild PostgreSQL schema: as SQLite's turn_context migration. `traceparent` (W3C,
-- CONTRACT §12.1 v4): the span a turn's span descends from (its resumed run, §18, stays
-- in the caller's trace), and on an inbox entry the span that delivered it (the wake
-- that drains it continues it, also on another node); `client_offer`: a /v1 client's
-- tools and request fields for the turn (§17.1, JSON, bounded), offered again on resume.
ALTER TABLE turns ADD COLUMN traceparent TEXT;
ALTER TABLE turns ADD COLUMN client_offer TEXT;
ALTER TABLE inbox ADD COLUMN traceparent TEXT;
