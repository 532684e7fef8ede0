"""The heart: the bus (bus.py), the wire shape (events.py), one turn (turn.py) and what
its engine yields (interpreter.py), one session's inbox (inbox.py) with delivery and
wakes (delivery.py), the sessions that own turns (sessions.py) and their recovery
(recovery.py); writes mirrored in memory go through mirror.py. Imports engines/, tools/,
store/; never api/. No import cycle inside it: pieces that reach back get a narrow
interface (ToolSite, RunningTurn, SubAgentHost, WakeHost, RecoveryHost).
"""
