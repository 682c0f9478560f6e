"""runtime.ThreadTuner: the thread count of a repeated step chosen by timing it. The rules on
given timings (deterministic), then on Whisper: the tuned decoder gives the tokens a fixed thread
count gives, and its step timings are recorded per shape."""
from __future__ import annotations

import pytest
import torch

from photon_core.runtime.thread_tuner import ThreadTuner


def _drive(tuner: ThreadTuner, key, cost: dict[int, float], steps: int) -> list[int]:
    """Run `steps` steps whose duration per thread count is `cost`; the counts chosen."""
    chosen = []
    for _ in range(steps):
        n = tuner.choose(key)
        tuner.record(key, n, cost[n])
        chosen.append(n)
    return chosen


def test_finds_the_faster_count_and_keeps_it():
    tuner = ThreadTuner((1, 2), retry_every=16)
    chosen = _drive(tuner, "a", {1: 4e-3, 2: 3e-3}, 200)
    assert chosen[0] == 1                    # starts on the first choice (the safe one)
    switch = chosen.index(2)
    assert switch <= 17                      # tried at the first re-try ...
    assert set(chosen[switch:]) == {2} or chosen[switch:].count(1) <= 4   # ... and kept (1 re-tried rarely)
    assert tuner.fastest("a") == 2


def test_a_slower_count_is_retried_less_and_less():
    tuner = ThreadTuner((1, 2), retry_every=16, max_retry_every=256)
    chosen = _drive(tuner, "a", {1: 4e-3, 2: 0.2}, 2000)   # 2 threads: a descheduled worker each op
    retries = [i for i, n in enumerate(chosen) if n == 2]
    assert chosen.count(1) > 0.99 * len(chosen)
    gaps = [b - a for a, b in zip(retries, retries[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == 257        # doubling up to the cap
    assert len(retries) <= 13


def test_follows_a_change_of_load():
    tuner = ThreadTuner((1, 2), retry_every=16)
    _drive(tuner, "a", {1: 4e-3, 2: 3e-3}, 100)
    assert tuner.fastest("a") == 2
    busy = _drive(tuner, "a", {1: 6e-3, 2: 0.1}, 100)      # another process takes a core
    assert tuner.fastest("a") == 1 and busy[-50:].count(2) <= 2
    idle = _drive(tuner, "a", {1: 4e-3, 2: 3e-3}, 300)     # and leaves
    assert tuner.fastest("a") == 2 and idle[-50:].count(1) <= 2


def test_a_new_shape_starts_on_the_last_fastest_count():
    tuner = ThreadTuner((1, 2), retry_every=16)
    _drive(tuner, "long", {1: 5e-3, 2: 3e-3}, 60)
    assert tuner.choose("short") == 2
    assert tuner.fastest("short") is None


def test_run_times_fn_and_restores_threads():
    tuner = ThreadTuner((1,))
    before = torch.get_num_threads()
    seen = []
    assert tuner.run("k", lambda: seen.append(torch.get_num_threads()) or 7) == 7
    assert seen == [1] and torch.get_num_threads() == before
    assert tuner.fastest("k") == 1
    with pytest.raises(RuntimeError):
        tuner.run("k", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError):
        ThreadTuner((0, 2))


def test_whisper_steps_tuned_give_the_fixed_tokens():
    """Thread counts split work, not arithmetic that changes a token: the tuned decoder (trying 1
    and 2 threads) and a fixed single thread read a real utterance to the same tokens."""
    from photon_core.models.whisper import load_whisper
    from whisper_fixtures import SENTENCES, espeak
    if torch.get_num_threads() < 2:
        pytest.skip("one CPU: nothing to choose between")
    model = load_whisper("whisper-tiny.en")
    tuner = model.decoder.threads
    assert isinstance(tuner, ThreadTuner) and tuner.choices == (1, torch.get_num_threads())
    pcm, rate = espeak(*SENTENCES["medium"])
    tuner.retry_every = 2                       # try both counts within one utterance
    tuned = model.transcribe_detailed(pcm, rate, temperature=0.0)[1].tokens
    assert any(len(w.seconds) == 2 for w in tuner._workloads.values())
    model.decoder.threads = ThreadTuner((1,))
    fixed = model.transcribe_detailed(pcm, rate, temperature=0.0)[1].tokens
    assert tuned == fixed and len(fixed) > 10
