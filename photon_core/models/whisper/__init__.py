"""Whisper speech recognition on photon_core backends: `load_whisper(...).transcribe(audio)`."""
from .transcribe import WhisperSpeech, load_whisper

__all__ = ["load_whisper", "WhisperSpeech"]
