"""Whisper's logit rules as device ops (device_rules.py) against the host's own (decoding.py's
_apply_rules + argmax + log-probability), row by row on random logits and random histories of text
and timestamp tokens, over several steps with each side keeping its own history; and two clips'
windows decode on the megakernel as the rows of one bucket. (A single window's rounds, one read
of the device per round with the host's tokens and log-probabilities, are
test_whisper_megakernel's transcription test.)"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

from photon_core.models.whisper import load_whisper  # noqa: E402
from photon_core.models.whisper.device_rules import DeviceRules  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return load_whisper("whisper-tiny.en", dtype="float32", backend="reference")


def history(gen: torch.Generator, tb: int, eot: int, n_ts: int) -> list[int]:
    """1-5 tokens, each a text token or (half the time) a timestamp."""
    out = []
    for _ in range(int(torch.randint(1, 6, (1,), generator=gen))):
        if torch.rand(1, generator=gen) < 0.5:
            out.append(tb + int(torch.randint(0, n_ts, (1,), generator=gen)))
        else:
            out.append(int(torch.randint(0, eot, (1,), generator=gen)))
    return out


@pytest.mark.parametrize("timestamps", [True, False])
def test_device_rules_choose_as_the_host_rules(model, timestamps):
    dec = model.decoder
    tok = dec.tok
    tb, eot, V = tok.timestamp_begin, tok.eot, dec.n_vocab
    B, steps = 24, 6
    gen = torch.Generator().manual_seed(11 + timestamps)
    logits = torch.zeros(B, V)
    rules = DeviceRules(dec, logits)
    sampled = [history(gen, tb, eot, 40) for _ in range(B)]
    rules.reset(sampled, timestamps)
    chose_ts = forced = total = 0
    for _ in range(steps):
        fresh = torch.randn(B, V, generator=gen) * 3
        # Timestamps as a block sometimes far more likely than text, sometimes far less: the rule
        # forcing a timestamp must both fire and not fire.
        fresh[:, tb:] += torch.empty(B, 1).uniform_(-9, 3, generator=gen)
        logits.copy_(fresh)
        got, score = rules()
        for r in range(B):
            row = fresh[r].clone()
            dec._apply_rules(row, sampled[r], timestamps)
            want = int(torch.argmax(row))
            assert int(got[r]) == want, (r, sampled[r])
            assert float(score[r]) == torch.log_softmax(row, dim=-1)[want].item()
            forced += bool(timestamps and torch.isinf(row[:tb]).all())
            chose_ts += want >= tb
            total += 1
            sampled[r].append(want)
    if timestamps:   # every branch of the grammar was taken and not taken
        assert 0 < chose_ts < total and 0 < forced < total
    with pytest.raises(ValueError, match="at least one"):
        rules.reset([[]] * B, timestamps)


def test_megakernel_batch_of_windows_decodes_as_rows_of_a_bucket(model, monkeypatch):
    """Two clips through WhisperSpeech.batch on the megakernel: their first windows decode as the
    rows of the 2-row bucket in rounds on the device (rows finishing at different steps: 6 and 5
    launches, the last round's 2 steps), and each clip's transcript is the reference path's for
    that clip alone."""
    from test_whisper_megakernel import CHUNK, INTERPRETER_TILING, rounds_of
    from speech_audio import espeak_pcm
    from photon_core.models.whisper.megakernel_steps import MegakernelSteps

    clips = [espeak_pcm(t) for t in ("Stop right there.", "Turn left.")]
    want = [model.transcribe(pcm, rate) for pcm, rate in clips]
    rounds_of(monkeypatch)   # rounds of CHUNK launches: 3 rounds, 6 launches (one round of 8 in production)
    steps = MegakernelSteps(model.net, tiling=INTERPRETER_TILING)
    model.decoder.steps = steps
    try:
        got = model.batch([dict(audio=pcm, sample_rate=rate) for pcm, rate in clips])
    finally:
        model.decoder.steps = None
    for g, w in zip(got, want):
        assert g["text"] == w["text"] and g["segments"] == w["segments"]
    assert len({len(w["text"]) for w in want}) == 2
    loop = steps._loops[2][1]   # one batch, no window alone; one read a round of the longer row's 6 launches
    assert loop.chunk == CHUNK and loop.rounds == -(-6 // CHUNK) and steps._loops[1] is None
