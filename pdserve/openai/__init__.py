"""The OpenAI-compatible HTTP front door of the router (see server.py)."""
