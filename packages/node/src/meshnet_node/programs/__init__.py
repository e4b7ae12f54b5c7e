"""Decode programs: a decoder layer's one-token step as one flat function (docs/adr/0041)."""

from meshnet_node.programs.decode import DecodeProgram, decode_programs
from meshnet_node.programs.layers import ENGINES, StageLayers, drain

__all__ = ["ENGINES", "DecodeProgram", "StageLayers", "decode_programs", "drain"]
