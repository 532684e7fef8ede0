"""veild: an agent-runtime daemon on Trio.

Layers, imports pointing down only:
    api/ (transports) -> runtime/ (turn, sessions, bus) -> engines/, tools/ -> llm/, store/
"""

__version__ = "0.1.0"
