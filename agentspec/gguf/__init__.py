"""GGUF files: agentspec's own reader (``reader.py``), every count and offset checked against the file."""

from .reader import GGML_TYPES, GGUFFile, GGUFTensor, read_gguf

__all__ = ["GGML_TYPES", "GGUFFile", "GGUFTensor", "read_gguf"]
