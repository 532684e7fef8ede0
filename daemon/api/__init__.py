"""Transports: thin HTTP, SSE and WebSocket handlers over the runtime.

They parse and validate, call the runtime, subscribe to the bus and render. They never
publish events themselves. Imports runtime/ and errors; nothing imports api/ but serve/.
"""
