"""csd-serve: LLM inference with Calibrated Speculative Decoding."""

__version__ = "0.1.0"
