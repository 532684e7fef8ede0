"""MCP tool servers (CONTRACT §10): the daemon owns them; agents call their tools."""
