"""Studio: the static browser UI served at /studio (CONTRACT §8).

Plain HTML, CSS and ES modules; no build step and no vendored library. Nothing here is
Python beyond this marker: daemon.api.studio reads these files and serves them.
"""
