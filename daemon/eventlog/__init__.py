"""Event logs behind the runtime's EventLog port (runtime/ports.py).

memory.py keeps recent events in memory only (tests, the bench's baseline); sqlite.py is
the embedded default, durable in `data_dir/events.db`; redis.py is the cluster's, over
redis_writer.py (appends), redis_tailer.py (tails, replays) and redis_stream.py (what the
two share). Imports runtime.events, errors and redisconn only.
"""
