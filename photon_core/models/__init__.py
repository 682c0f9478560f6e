"""Model definitions (Whisper, Moondream) on top of the backend ops."""
