"""The CPU runtime: linear and attention kernels, their build and self-check (``kernels`` and the
modules it gathers, ``csrc/``), and the lean forward of Llama-shaped targets (``fastpath``). It imports
nothing of ``specdec.forward``: the forward calls into the runtime, never the reverse.

``use(config)`` runs a block under a ``specdec.config.RuntimeConfig``."""

from specdec.config import RuntimeConfig, use

__all__ = ["RuntimeConfig", "use"]
