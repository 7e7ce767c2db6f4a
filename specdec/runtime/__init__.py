"""The CPU runtime: linear and attention kernels and their build (``kernels``, ``csrc/``), the lean
forward of Llama-shaped targets (``fastpath``)."""
