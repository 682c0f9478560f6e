"""A speech model without weights, for tests of the speech node's lifecycle and parameters: a
configure "loads" it at once, so a test can drive configure, activate, deactivate and cleanup
as a manager does, and make its transcriptions fail or recover."""
from photon_core.runtime.shared_models import SharedModel

import photon_ros.speech_node as speech_node


class FakeSpeechModel:
    """English-only and reading no prompt while `english_only` (whisper-tiny.en refuses "de",
    Parakeet any prompt); every transcription raises while `broken` names a reason."""
    model_id = "fake-speech"

    def __init__(self) -> None:
        self.english_only = True
        self.broken = ""

    def check_language(self, language: str | None) -> None:
        if self.english_only and language not in (None, "en"):
            raise ValueError(f"{self.model_id} is English-only, got {language!r}")

    def check_prompt(self, prompt: str | None) -> None:
        if self.english_only and prompt:
            raise ValueError(f"{self.model_id} reads no prompt")

    def warmup(self, language=None, initial_prompt=None) -> None:
        pass

    def transcribe(self, audio, sample_rate, language=None, initial_prompt=None, **options) -> dict:
        if self.broken:
            raise RuntimeError(self.broken)
        return {"text": "", "language": language or "en", "segments": []}


def fake_speech_model(monkeypatch) -> FakeSpeechModel:
    """The model every speech node's configure loads from now on (whatever `model` names)."""
    model = FakeSpeechModel()

    def load(name: str, device: str) -> SharedModel:
        engine = SharedModel(model)
        engine.holders = 1   # as shared_engine hands it out: cleanup gives the hold back
        return engine

    monkeypatch.setattr(speech_node, "load_speech_model", load)
    return model
