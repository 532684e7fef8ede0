-- veild PostgreSQL schema 4: when a turn's end was stored, on the store's clock. A node
-- stores a turn's end and then appends its terminal to the bus; a node paused (or
-- killed) between the two is swept, and its terminal is refused by the bus's fence. The
-- sweep looks at the turns whose end that node stored in its last leases and publishes
-- the stored end for each one the log holds no terminal of (cluster/node.py), so every
-- turn still has exactly one terminal (CONTRACT §5.2, §13.8).
ALTER TABLE turns ADD COLUMN end_stored_ms BIGINT;
CREATE INDEX turns_end_stored ON turns(end_stored_ms) WHERE end_stored_ms IS NOT NULL;
