"""The scheduler: OpenAI-compatible front end, request state, placement and migration (no torch)."""
