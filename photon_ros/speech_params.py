"""The speech node's parameters: each declared once, with its meaning, range and when a change
takes effect (photon_ros.params). The VAD's are checked together (tail_s within hangover_s)."""
from __future__ import annotations

from typing import Any

from photon_ros.audio_common_conversions import MGONZS13, ROS_DRIVERS, audio_common_types, family_of
from photon_ros.engine_params import DEVICES, device_refusal, model_refusal
from photon_ros.params import Param
from photon_ros.speech_segmenter import SegmenterConfig

# input_type -> (ROS type of the audio messages, family) for the two audio_common_msgs packages
# (photon_ros/audio_common_conversions.py); usable where that family's package is installed.
AUDIO_COMMON_INPUTS = {
    "audio_stamped": ("audio_common_msgs/msg/AudioStamped", MGONZS13),
    "audio_data_stamped": ("audio_common_msgs/msg/AudioDataStamped", ROS_DRIVERS),
    "audio_data": ("audio_common_msgs/msg/AudioData", ROS_DRIVERS),
}
INPUT_TYPES = ("audio_chunk", "int16", "float32", *AUDIO_COMMON_INPUTS)
RELIABILITIES = ("best_effort", "reliable")
# Rates outside this range are a malformed message, not audio we can use.
MIN_RATE, MAX_RATE = 4000, 384000


def checked_rate(pcm: Any) -> Any:
    """`pcm` (audio_conversions.Pcm) when its rate is one the node takes; else the ValueError that
    refuses its chunk (the node and the evaluator's prediction of it share this rule)."""
    if not MIN_RATE <= pcm.sample_rate <= MAX_RATE:
        raise ValueError(f"sample rate {pcm.sample_rate} Hz is outside {MIN_RATE}..{MAX_RATE} Hz")
    return pcm


# vad.<name> parameter -> SegmenterConfig field: the settings a user tunes.
VAD_SETTINGS = ("threshold_db", "continue_db", "min_level_db", "hangover_s", "tail_s", "min_speech_s",
                "max_utterance_s", "max_gap_s")


def speech_params() -> list[Param]:
    vad = SegmenterConfig()
    return [
        Param("model", "whisper-tiny.en", "checkpoint: a known name, a folder or a file; any family that "
              "transcribes (Whisper, Parakeet TDT, Qwen3-ASR)", applies="configure", check=model_refusal),
        Param("device", "cpu", DEVICES, applies="configure", check=device_refusal),
        Param("input_type", "audio_chunk", "message type on `audio`: photon_ros/AudioChunk; std_msgs "
              "Int16MultiArray / Float32MultiArray; audio_common_msgs AudioStamped (mgonzs13), or "
              "AudioDataStamped / AudioData with AudioInfo on `audio_info` (ros-drivers)",
              choices=INPUT_TYPES, applies="configure", check=input_unavailable),
        Param("reliability", "best_effort", "QoS of the audio subscription: best_effort matches best-effort "
              "(microphone drivers) and reliable publishers alike", choices=RELIABILITIES, applies="configure"),
        Param("sample_rate", 16000, "Hz of std_msgs array input (the arrays carry none)", low=MIN_RATE, high=MAX_RATE),
        Param("channels", 1, "channels of std_msgs array input, interleaved", low=1, high=64),
        Param("check_sample_rate", True, "std_msgs array input: warn (log, /diagnostics) when audio arrives over 10% "
              "faster or slower than sample_rate says (over 5 s); false for replays not at real time"),
        Param("frame_id", "", "frame id of the transcripts; empty keeps the audio's"),
        Param("language", "", "language code for multilingual models (en, de, ...); empty: the model decides "
              "(Whisper and Qwen3-ASR detect it; Parakeet takes none and refuses one)"),
        Param("initial_prompt", "", "text given to the model before each utterance (names, jargon; Parakeet "
              "reads none and refuses one)"),
        Param("idle_flush_s", 0.8, "no audio for this long (and for two chunks' time, and two of a steady stream's gaps between "
              "chunks, up to 4x this) ends the utterance in progress "
              "(incomplete; speech after it continues that utterance, incomplete too)", positive=True),
        Param("input_timeout_s", 5.0, "no audio for this long while active: /diagnostics warns that the source may have "
              "stopped (a microphone driver that died, a cable); 0: never", low=0.0),
        Param("partial_interval_s", 0.5, "seconds of speech between partial transcripts; 0: none", low=0.0),
        Param("first_partial_s", 0.3, "seconds of speech before the first partial transcript", low=0.0),
        Param("speculate", True, "decode the final ahead while the hangover is waited for"),
        Param("max_pending_s", 60.0, "audio waiting for the model beyond this drops the oldest utterances",
              positive=True, applies="restart"),
        Param("vad.threshold_db", vad.threshold_db, "speech starts when the level is this far above the noise floor "
              "(dB)", low=0.0),
        Param("vad.continue_db", vad.continue_db, "speech, once started, goes on while the level is this far above "
              "the noise floor (dB)", low=0.0),
        Param("vad.min_level_db", vad.min_level_db, "speech needs at least this absolute level too (dBFS): quieter "
              "sound is never speech", high=0.0),
        Param("vad.hangover_s", vad.hangover_s, "a pause this long ends an utterance", positive=True),
        Param("vad.tail_s", vad.tail_s, "seconds of the pause that ends an utterance kept after its last speech "
              "(at most vad.hangover_s)", low=0.0),
        Param("vad.min_speech_s", vad.min_speech_s, "speech this long starts an utterance", positive=True),
        Param("vad.max_utterance_s", vad.max_utterance_s, "longer speech is cut here (marked incomplete)",
              positive=True),
        Param("vad.max_gap_s", vad.max_gap_s, "stamp jitter tolerated between chunks, and never more than half a "
              "chunk (one lost chunk must show); more is lost audio", positive=True),
    ]


def audio_common_input(input_type: str) -> type:
    """The message class an audio_common input_type subscribes to; ValueError saying what to
    install when its family's audio_common_msgs is not importable here."""
    name, family = AUDIO_COMMON_INPUTS[input_type]
    found = audio_common_types().get(name)
    if found is None or family_of(found) != family:
        where = {MGONZS13: "mgonzs13/audio_common", ROS_DRIVERS: "ros-drivers/audio_common (apt)"}[family]
        raise ValueError(f"input_type {input_type} needs the audio_common_msgs of {where} ({name}), "
                         "which is not installed here")
    return found


def input_unavailable(input_type: str) -> str:
    """Why `input_type` cannot be subscribed to here ("" when it can)."""
    if input_type not in AUDIO_COMMON_INPUTS:
        return ""
    try:
        audio_common_input(input_type)
    except ValueError as err:
        return str(err)
    return ""


def vad_config(values: dict[str, Any]) -> SegmenterConfig:
    """The segmenter's settings from the node's parameter values."""
    return SegmenterConfig(**{name: values[f"vad.{name}"] for name in VAD_SETTINGS})


def check_vad(values: dict[str, Any]) -> str:
    """Why the VAD settings cannot work together ("" when they can)."""
    try:
        vad_config(values).check()
    except ValueError as err:
        return str(err)
    return ""
