"""veild: an agent-runtime daemon on Trio.

Layers, imports pointing down only (docs/architecture.md):
    cli/ (the command), serve/ (the process) -> api/ (transports) -> runtime/ (turn,
    sessions, bus) -> engines/, tools/, mcp/ -> toolproc/ (a tool's process), llm/, store/
"""

__version__ = "0.1.0"
