-- veild PostgreSQL schema 9: the lease epoch of the node that stored a turn's end. A
-- node stores a turn's end and then its writer appends the terminal to the bus; a node
-- that stops between the two is swept and the sweep publishes the stored end (schema 4).
-- Found by the time the end was stored (the node's last leases), a writer stuck for
-- longer than that before its node died was missed; found by the ending node's epoch,
-- it is not, however long the writer was stuck (cluster/node.py). NULL: stored by a
-- daemon that was not a node, or before this column (the time window still finds those).
ALTER TABLE turns ADD COLUMN end_epoch BIGINT;
CREATE INDEX turns_end_epoch ON turns(end_epoch) WHERE end_epoch IS NOT NULL;
-- The epoch a swept node died with (its row's `epoch` is the fence's from the sweep on):
-- set by the fence, so a sweep retried after a failure still finds that node's ends.
ALTER TABLE nodes ADD COLUMN dead_epoch BIGINT;
