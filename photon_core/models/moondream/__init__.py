"""Moondream 2 (vision-language model) in plain PyTorch ops: detect, point, caption, query."""
from .model import EncodedImage, MoondreamModel, load_moondream

__all__ = ["EncodedImage", "MoondreamModel", "load_moondream"]
