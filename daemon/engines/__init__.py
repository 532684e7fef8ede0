"""Engines: async generators of typed events (base.py). openai.py drives a Chat
Completions loop with veild's tools. Engines know nothing of the bus, HTTP or cancel
reasons. Imports llm/, tools/, store/ models and errors.
"""
