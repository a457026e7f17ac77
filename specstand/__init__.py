"""specstand: lossless speculative decoding for LLM agents, and the stand that measures it."""

__version__ = "0.1.0"
