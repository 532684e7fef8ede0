"""Provider clients: HTTP in, typed deltas out. Imports errors only."""
