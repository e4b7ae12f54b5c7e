"""meshnet tracker: coverage map, routing and the OpenAI-compatible entry point."""

__version__ = "0.1.0"
