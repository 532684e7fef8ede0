"""The cluster's shared pieces (CONTRACT §13, docs/cluster.md).

redis.py connects to the Redis a `[cluster] bus` URL names (the event log in
eventlog/redis.py and the control channel share that client); control.py is the per-node
request/reply channel a node uses to run an operation on a session's owner node;
ports.py what the cluster needs of its store beyond the runtime's Store (Coordination:
nodes, leases, fences, ownership, advisory locks — store/pg_coordination.py).
"""
