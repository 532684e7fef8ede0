"""`veild mock-provider`: a scripted OpenAI-compatible provider for demos and tests."""
