"""The process shell: server.py builds the daemon (stores, runtime, API, services) and runs it
on api/httpserver.py under signals; sdnotify.py talks to systemd. The top layer: imports any
package; nothing imports serve/ but the CLI's `serve` (and the bench and tests).
"""
