"""Schedules (CONTRACT §11): agents that run by themselves.

timing.py (pure: `every` grids and cron lines in a named zone) and scheduler.py (the one
service that ticks them and starts turns through the session manager). Imports the
runtime (sessions, the Store port) and config; nothing below imports this package.
"""
