"""Weights at the size people run them: int8 and int4 quantized at load, FP8 and MXFP4 kept
as shipped, every family's Linears and routed experts (docs/adr/0031). ``packed`` holds the
weight formats and their products, ``shipped`` the checkpoint formats, ``modules`` the
Linear and experts that run them, ``loading`` packs a range tensor by tensor."""
