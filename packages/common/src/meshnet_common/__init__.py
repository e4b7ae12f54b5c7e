"""Shared types, wire format and checkpoint logic for meshnet's tracker and nodes."""

from meshnet_common.layers import LayerRange

__all__ = ["LayerRange"]
__version__ = "0.1.0"
