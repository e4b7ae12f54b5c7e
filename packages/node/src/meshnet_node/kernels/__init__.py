"""Compute kernels of this project's own, each bit for bit equal to the torch operation it
stands in for (docs/adr/0030). Torch only: the engine uses them, they use nothing above."""
