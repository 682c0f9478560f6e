"""No cold first utterance: after `warmup()`, the speech node's first real command (a partial
transcript of the audio so far, then the final one, at a WAV's 22.05 kHz and with a text prompt)
runs nothing the warm-up did not: no module to import, no cache to fill, no torch operator never
run before. Checked in a fresh process, since this one has run everything already. Speed is not
asserted (machines differ); what makes a first call slow is."""
import json
import subprocess
import sys

from speech_audio import espeak_wav, words

SENTENCE = "Go to the kitchen and bring me a glass of water."

_FIRST_COMMAND = r'''
import json, sys
import numpy as np
from torch.profiler import ProfilerActivity, profile
from photon_core.audio_io import read_wav
from photon_core.models.whisper import load_whisper

def operators(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}

def cache_misses():
    return {f"{m.__name__}.{name}": f.cache_info().misses
            for m in list(sys.modules.values()) if m and m.__name__.startswith("photon_core")
            for name, f in list(vars(m).items()) if hasattr(f, "cache_info")}

pcm, rate = read_wav(sys.argv[1])
prompt = "kitchen, robot"
model = load_whisper("whisper-tiny.en", dtype="float32")
warm_ops = operators(lambda: model.warmup(initial_prompt=prompt))
modules, misses = set(sys.modules), cache_misses()
# What the speech node does with the first command: partials while it is spoken, then the final.
first = []
first_ops = operators(lambda: first.extend([
    model.transcribe(pcm[:2 * rate], rate, timestamps=False, temperature=0.0, initial_prompt=prompt),
    model.transcribe(pcm, rate, initial_prompt=prompt)]))
print(json.dumps({"new_modules": sorted(set(sys.modules) - modules),
                  "new_operators": sorted(first_ops - warm_ops),
                  "cache_misses": {k: v - misses.get(k, 0) for k, v in cache_misses().items()
                                   if v != misses.get(k, 0)},
                  "warm_operators": len(warm_ops),
                  "text": first[-1]["text"]}))
'''


def test_the_first_command_after_warmup_runs_nothing_new():
    wav = espeak_wav(SENTENCE)
    out = subprocess.run([sys.executable, "-c", _FIRST_COMMAND, str(wav)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert words(report["text"]) == words(SENTENCE)    # real speech went through: the final's words
    assert report["warm_operators"] > 20                 # the profiler saw the warm-up
    assert report["new_modules"] == []
    assert report["new_operators"] == []
    assert report["cache_misses"] == {}
