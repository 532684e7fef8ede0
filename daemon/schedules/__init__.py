"""Schedules (CONTRACT §11): agents that run by themselves.

scheduler.py (the one service that ticks them and starts turns through the session
manager) and launch.py. Imports the runtime (sessions, the Store port), config and
daemon/timing.py (the pure `every` grids and cron lines config parses); nothing below
imports this package.
"""
