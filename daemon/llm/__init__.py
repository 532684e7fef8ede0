"""Provider clients: HTTP in, typed deltas out. Imports errors only.
transport.py reads a provider's HTTP/1.1 stream on Trio sockets; provider_http.py picks it
or httpx per provider; sse.py turns either into `data:` payloads and ProviderErrors."""
