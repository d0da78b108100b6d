"""Quantized deployment: weight-only INT8 / INT4 (RTN, AWQ) / FP8, GGUF tensors kept compact,
and quantized checkpoints. See ``model.py`` for the entry points."""
