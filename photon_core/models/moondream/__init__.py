"""Moondream 2 (vision-language model) in plain PyTorch ops: detect, point, caption, query."""
from .batch import Request
from .model import EncodedImage, MoondreamModel, load_moondream

__all__ = ["Request", "EncodedImage", "MoondreamModel", "load_moondream"]
