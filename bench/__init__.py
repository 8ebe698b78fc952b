"""Benchmarks of Calibrated Speculative Decoding: speed, acceptance and quality against vanilla decoding,
strict SD, the lossy baseline and transformers' own prompt-lookup generation. Run `python -m bench`."""
