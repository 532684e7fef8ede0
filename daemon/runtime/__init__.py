"""The heart: the bus (bus.py), the wire shape (events.py), one turn (turn.py), one
session's inbox (inbox.py) and the sessions that own turns (sessions.py). Imports
engines/, tools/, store/; never api/.
"""
