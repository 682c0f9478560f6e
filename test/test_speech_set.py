"""The spoken test set (bench/speech_set.py) and its word error rate (bench/wer.py): the WER
normalises numbers and punctuation the same way on both sides; a slice of the set keeps the
manifest's promises (durations, SNR measured on the samples, voices, rates, determinism); Whisper
tiny.en (real weights) understands its clean utterances."""
import json

import numpy as np
import pytest

from speech_audio import bench_module, set_pcm, speech_set

wer_module = bench_module("wer")
builder = bench_module("speech_set")


# --- WER ----------------------------------------------------------------------------------------

def test_normalize_spells_numbers_and_drops_case_and_punctuation():
    normalize = wer_module.normalize
    assert normalize("Turn 90 degrees, NOW!") == ["turn", "ninety", "degrees", "now"]
    assert normalize("Go to room 214.") == normalize("go to room two hundred and fourteen")
    assert normalize("25%") == ["twenty", "five", "percent"]
    assert normalize("Lower it by 2.5cm") == ["lower", "it", "by", "two", "point", "five",
                                                  "centimeters"]
    assert normalize("the 3rd floor, 1,500 boxes") == ["the", "third", "floor", "one", "thousand",
                                                       "five", "hundred", "boxes"]
    assert normalize("Dr. Patel's lab") == ["doctor", "patels", "lab"]
    assert normalize("twenty-one") == ["twenty", "one"]
    # "and" between ordinary words is a word, and counts.
    assert normalize("bread and milk") == ["bread", "and", "milk"]


def test_number_words():
    assert [wer_module.number_words(n) for n in (0, 13, 40, 105, 2000, 1_000_001)] == [
        "zero", "thirteen", "forty", "one hundred five", "two thousand", "one million one"]


def test_wer_counts_substitutions_insertions_and_deletions():
    wer = wer_module.wer
    assert wer(["turn on the lights"], ["Turn on the lights."]) == 0.0
    assert wer(["turn on the lights"], ["turn off the lights"]) == 0.25
    assert wer(["turn on the lights"], ["turn on lights"]) == 0.25
    assert wer(["turn on the lights"], ["turn on the the lights now"]) == 0.5
    assert wer(["stop"], [""]) == 1.0
    # Pooled over all words: one error in a 1-word and none in a 3-word utterance is 1/4.
    assert wer(["stop", "go left now"], ["top", "go left now"]) == 0.25
    assert wer_module.edit_distance("kitten", "sitting") == 3


def test_wer_rejects_what_it_cannot_score():
    with pytest.raises(ValueError, match="2 references but 1"):
        wer_module.wer(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="no words"):
        wer_module.wer(["?!"], ["hello"])


# --- the set ------------------------------------------------------------------------------------

def test_the_whole_set_is_broad_as_specified():
    """The spec alone (nothing built): enough utterances, voices, rates and noise."""
    entries = builder.entries()
    assert len(entries) >= 60 and len({e.id for e in entries}) == len(entries)
    assert {e.kind for e in entries} == {"command", "number", "name", "dictation"}
    assert len({e.voice.split("+")[0] for e in entries}) >= 5 and any("+" in e.voice for e in entries)
    assert all(130 <= e.rate <= 200 for e in entries) and len({e.rate for e in entries}) >= 4
    noisy = [e for e in entries if e.noise]
    assert len(noisy) == len(entries) // 2 and all(10.0 <= e.snr_db <= 20.0 for e in noisy)
    assert {e.noise for e in noisy} == {"white", "pink", "brown"}
    assert any(e.word_gap_ms for e in entries)
    assert set(builder.SLICE) <= {e.id for e in entries}


@pytest.fixture(scope="module")
def slice_set():
    return speech_set(builder.SLICE)


def test_slice_manifest_matches_the_audio(slice_set):
    folder, rows = slice_set
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["entries"] == rows
    by_id = {r["id"]: r for r in rows}
    assert set(builder.SLICE) <= set(by_id)
    for row in rows:
        samples = set_pcm(folder, row)
        duration = samples.size / row["sample_rate"]
        assert abs(duration - row["duration_s"]) < 1e-3 and 1.0 <= duration <= 60.0
        assert 130 <= row["rate"] <= 200 and row["text"].strip()
        assert np.max(np.abs(samples)) < 1.0                       # nothing clipped
    assert len({by_id[i]["voice"] for i in builder.SLICE}) >= 4


def test_noisy_files_are_their_clean_twin_plus_noise_at_the_stated_snr(slice_set):
    folder, rows = slice_set
    by_id = {r["id"]: r for r in rows}
    noisy = [r for r in rows if r["noise"]]
    assert noisy
    for row in noisy:
        clean = set_pcm(folder, by_id[row["clean_id"]])
        mixed = set_pcm(folder, row)
        noise = mixed.astype(np.float64) - clean
        speech = builder.speech_span(clean).astype(np.float64)
        snr = 10 * np.log10(np.mean(speech ** 2) / np.mean(noise ** 2))
        assert abs(snr - row["snr_db"]) < 0.1, (row["id"], snr, row["snr_db"])
        assert 10.0 <= row["snr_db"] <= 20.0
        # The noise is there all along, padding included, as in a room.
        lead = round(row["lead_s"] * row["sample_rate"])
        assert np.std(noise[:lead]) > 0.1 * np.std(noise)


def test_building_again_gives_the_same_bytes(tmp_path, slice_set):
    folder, rows = slice_set
    ids = ("number-05-noisy",)
    again = builder.build(tmp_path, ids)
    for row in again:
        assert (tmp_path / row["file"]).read_bytes() == (folder / row["file"]).read_bytes()
    assert builder.build(tmp_path, ids) == again    # and a second call reuses the files


def test_whisper_tiny_en_understands_the_clean_slice(slice_set):
    from photon_core.models.whisper import load_whisper
    folder, rows = slice_set
    model = load_whisper("whisper-tiny.en", dtype="float32")
    clean = [r for r in rows if r["id"] in builder.SLICE and not r["noise"]]
    hypotheses = [model.transcribe(set_pcm(folder, r), r["sample_rate"])["text"] for r in clean]
    # Measured 0.0 on these four; the bound leaves room for a word flipping on another CPU.
    assert wer_module.wer([r["text"] for r in clean], hypotheses) < 0.2, hypotheses
