"""What an operator sees: Prometheus metrics, the event-loop lag probe, log formats and
the provider-request timing. Imports nothing from api/ or runtime/ (they import this);
what it reads of the runtime it is handed as plain callables.
"""
