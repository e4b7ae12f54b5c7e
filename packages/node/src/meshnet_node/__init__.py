"""meshnet node: loads one layer range of a model and runs it for many sessions."""

__version__ = "0.1.0"
