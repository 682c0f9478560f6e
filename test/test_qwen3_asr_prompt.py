"""Qwen3-ASR's prompt with a template of the checkpoints' layout (a system turn always, the
assistant turn inside transformers' {% generation %} tags) and with the fallback
for checkpoints that ship none: the same text as the original library's _build_text_prompt (system
turn with the context or empty, then "language X<asr_text>" when forced) and as transformers'
processor."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from test_qwen3_asr_reference import tiny_checkpoint

# The layout of the Qwen3-ASR checkpoints' chat template, written here in brief: the system turn
# always (the system messages' text, or empty), a user turn with an audio block per audio part,
# then the assistant's turn inside transformers' generation marks.
QWEN3_ASR_TEMPLATE = (
    "{%- set ns = namespace(system='', audio='') -%}"
    "{%- for m in messages -%}"
    "{%- for p in ([{'type': 'text', 'text': m.content}] if m.content is string else m.content) -%}"
    "{%- if m.role == 'system' and p.type == 'text' -%}{%- set ns.system = ns.system + p.text -%}"
    "{%- elif p.type == 'audio' -%}"
    "{%- set ns.audio = ns.audio + '<|audio_start|><|audio_pad|><|audio_end|>' -%}{%- endif -%}"
    "{%- endfor -%}{%- endfor -%}"
    "{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n<|im_start|>user\\n' + ns.audio + '<|im_end|>\\n' -}}"
    "{%- for m in messages if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{% generation %}{{- (m.content if m.content is string else m.content | map(attribute='text') | join)"
    " + '<|im_end|>\\n' -}}{% endgeneration %}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")

CASES = [("en", None, "English"), (None, None, None), ("German", "robot arm", "German"), (None, "kitchen", None)]


def _original_prompt(context: str | None, language: str | None) -> str:
    """qwen_asr's Qwen3ASRModel._build_text_prompt: system (context or ""), user audio, the
    generation prompt, then "language X<asr_text>" when the language is forced."""
    text = (f"<|im_start|>system\n{context or ''}<|im_end|>\n<|im_start|>user\n"
            "<|audio_start|><|audio_pad|><|audio_end|><|im_end|>\n<|im_start|>assistant\n")
    return text + (f"language {language}<asr_text>" if language else "")


def _folder(tmp_path, template: str | None):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint(), folder)
    for name in ("chat_template.jinja", "chat_template.json"):
        (folder / name).unlink(missing_ok=True)
    for name in ("tokenizer_config.json", "processor_config.json"):
        path = folder / name
        if path.is_file():
            data = json.loads(path.read_text())
            data.pop("chat_template", None)
            path.write_text(json.dumps(data))
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return folder


def _prompt(folder):
    from photon_core.models.qwen3_asr.prompt import Qwen3ASRPrompt
    return Qwen3ASRPrompt(folder, json.loads((folder / "config.json").read_text())["audio_token_id"])


def test_checkpoint_template_with_generation_tags_renders_the_original_prompt(tmp_path):
    """The template Qwen3-ASR checkpoints ship (with {% generation %}) loads and renders what the
    original library and transformers' processor render, token for token."""
    from transformers import Qwen3ASRProcessor

    folder = _folder(tmp_path, QWEN3_ASR_TEMPLATE)
    ours = _prompt(folder)
    processor = Qwen3ASRProcessor.from_pretrained(folder)
    silence = np.zeros(16000, np.float32)
    for language, context, name in CASES:
        want = _original_prompt(context, name)
        assert ours.render(language, context) == want
        assert processor.apply_transcription_request(audio=silence, language=language, prompt=context,
                                                     tokenize=False) == [want]
        before, after = want.split("<|audio_pad|>")
        assert ours.prompt_ids(3, language, context) == (ours.encode(before) + [ours.audio_token_id] * 3
                                                         + ours.encode(after))


@pytest.mark.parametrize("language,context,name", CASES)
def test_fallback_template_renders_the_original_prompt(tmp_path, language, context, name):
    """A checkpoint without a chat template: the fallback gives the same layout, the empty system
    turn included."""
    ours = _prompt(_folder(tmp_path, None))
    assert not ours.template.from_checkpoint
    assert ours.render(language, context) == _original_prompt(context, name)
