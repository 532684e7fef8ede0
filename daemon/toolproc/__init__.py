"""The tool process boundary: what a tool's process starts with (env.py), the sandbox it runs
in and its whole argv (sandbox.py), its limits (limits.py), its supervisor (supervise.py,
run by path) and process groups (procgroup.py). Imports config and errors only; used by
tools/, engines/ (claude-cli), mcp/ and runtime/.
"""
