"""Quantized weights kept in their GGUF blocks: the formats' reference dequantization
(``formats``), layers that compute with it (``modules``), and GGUF files loaded packed (``gguf``)."""

from specdec.formats import FORMATS, BlockFormat, block_format, dequantize
from specdec.quant.modules import QuantEmbedding, QuantLinear, quantize_model

__all__ = ["FORMATS", "BlockFormat", "QuantEmbedding", "QuantLinear", "block_format", "dequantize", "quantize_model"]
