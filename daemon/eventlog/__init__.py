"""Event logs behind the runtime's EventLog port (runtime/ports.py).

memory.py keeps recent events in memory only (tests, the bench's baseline); sqlite.py is
the embedded default, durable in `data_dir/events.db`. Imports runtime.events only.
"""
