"""The embedded store: SQLite in WAL mode behind one worker thread.

models.py holds the plain records; sqlite.py the database; migrations/ the numbered schema.
Imports nothing from the rest of the daemon but errors.
"""
