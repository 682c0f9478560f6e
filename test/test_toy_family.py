"""The toy eighth family (test/toy_family: a tiny Llama-shaped decoder on random weights, one
folder written as photon_core/README.md's "Adding a family" says) runs through the registry and
every backend with nothing of its own outside its folder: recognised from its files once
$PHOTON_EXTRA_FAMILIES names it (and never otherwise); its greedy tokens on the reference backend
equal transformers' LlamaForCausalLM on the same safetensors, and its `query` skill (text
only) answers with them in the contract's shape, alone, streamed and batched; the per-op Triton kernels and the
megakernel (Triton's interpreter on CPU) give the reference's tokens, greedy (on the megakernel
in device rounds) and seeded-sampled (the compiled step driven by the host)."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import functools  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import photon_core  # noqa: E402
from photon_core import contracts, registry  # noqa: E402
from photon_core.runtime.requests import Request  # noqa: E402
from photon_core.runtime.sampling import Sampling  # noqa: E402

from toy_family.random_checkpoint import write_checkpoint  # noqa: E402

PROMPTS = ("hi", "longer, é")
NEW = 8


@pytest.fixture(autouse=True)
def toy_registered(monkeypatch):
    monkeypatch.setenv(registry.EXTRA_FAMILIES, "toy_family")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[bool, Path]:
    root = tmp_path_factory.mktemp("toy")
    return {tied: (write_checkpoint(root / f"tied{int(tied)}", seed=int(tied), tied=tied), root / f"tied{int(tied)}")[1]
            for tied in (False, True)}


@functools.lru_cache(maxsize=None)
def model(folder: Path, backend: str):
    return photon_core.load(folder, backend=backend)


def greedy(m, prompts=PROMPTS) -> list[list[int]]:
    return m.generate_ids([m.tokenizer.encode(p) for p in prompts], [Sampling(NEW)] * len(prompts))


def test_the_registry_offers_it_only_when_named(folders, tmp_path, monkeypatch):
    misleading = tmp_path / "whisper-tiny.en"   # words in the path play no part
    shutil.copytree(folders[False], misleading)
    assert registry.recognise(misleading).family.name == "toy_llama"
    assert registry.families()[-1].name == "toy_llama"
    monkeypatch.delenv(registry.EXTRA_FAMILIES)
    assert "toy_llama" not in [f.name for f in registry.families()]
    with pytest.raises(registry.UnknownModelFamily, match="cannot tell"):
        registry.recognise(misleading)
    monkeypatch.setenv(registry.EXTRA_FAMILIES, "toy_family.config")
    with pytest.raises(ValueError, match="toy_family.config.*declares no FAMILY"):
        registry.families()


def test_bad_checkpoints_are_refused_by_name(folders, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(folders[False], broken)
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 3}))
    with pytest.raises(ValueError, match="not a multiple of 3 K/V heads"):
        photon_core.load(broken, backend="reference")
    (broken / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    write_checkpoint(tmp_path / "tied", tied=True)
    shutil.copy(tmp_path / "tied" / "model.safetensors", broken / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensors.*lm_head.weight"):
        photon_core.load(broken, backend="reference")


@pytest.mark.parametrize("tied", [False, True])
def test_reference_greedy_equals_transformers_llama(folders, tied):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    raw = json.loads((folders[tied] / "config.json").read_text())
    cfg = transformers.LlamaConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    cfg._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(cfg).eval()
    missing, unexpected = hf.load_state_dict(load_file(str(folders[tied] / "model.safetensors")), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tied else set())
    hf.tie_weights()
    want = []
    for p in PROMPTS:
        ids = [raw["bos_token_id"]] + list(p.encode())
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                              eos_token_id=raw["eos_token_id"], pad_token_id=raw["eos_token_id"])
        want.append([t for t in out[0, len(ids):].tolist() if t != raw["eos_token_id"]])
    assert max(len(set(w)) for w in want) > 3   # weights that decode more than a repeated token
    ours = model(folders[tied], "reference")
    assert isinstance(ours, contracts.TextModel) and not isinstance(ours, contracts.VisionModel)
    assert contracts.check_model(ours, {"query"}) is ours
    with pytest.raises(contracts.ContractError, match="caption"):   # a text model has no image skills
        contracts.check_model(ours, {"query", "caption"})
    assert greedy(ours) == want
    # the query skill: one call, streamed, and a batch, shaped as photon_core.contracts says
    text = [ours.tokenizer.decode(w) for w in want]
    settings = {"temperature": 0, "max_tokens": NEW}
    assert ours.query(None, PROMPTS[1], settings=settings) == {"answer": text[1]}
    assert "".join(ours.query(None, PROMPTS[1], stream=True, settings=settings)["answer"]) == text[1]
    answers = ours.batch([Request("query", None, p, max_tokens=NEW) for p in PROMPTS])
    assert answers == [{"answer": t} for t in text]
    for answer in answers:
        contracts.check_result("query", answer)
    with pytest.raises(ValueError, match="text only"):
        ours.query(np.zeros((4, 4, 3), np.uint8), "what is this?")
    nine = ours.batch([Request("query", None, PROMPTS[0], max_tokens=1)] * 9)   # past one batch bucket
    assert nine == [{"answer": ours.tokenizer.decode(want[0][:1])}] * 9


def test_per_op_triton_gives_the_reference_tokens(folders):
    assert greedy(model(folders[False], "triton")) == greedy(model(folders[False], "reference"))


def test_megakernel_gives_the_reference_tokens(folders):
    """Greedy: a batch of two (bucket 2, rows of their own lengths) in rounds on the device; then
    seeded sampling, where the host steps the compiled step once per token and finished rows
    leave the batch."""
    ref, mk = model(folders[True], "reference"), model(folders[True], "megakernel")
    assert greedy(mk) == greedy(ref)
    assert mk.decode.loop(2).rounds > 0
    jobs = [Sampling(NEW, temperature=1.0, top_p=0.9), Sampling(3, temperature=0.7)]
    prompts = [ref.tokenizer.encode(p) for p in PROMPTS]
    out = []
    for m in (ref, mk):
        m.generator.manual_seed(5)
        out.append(m.generate_ids(prompts, jobs))
    assert out[0] == out[1] and len(out[0][1]) <= 3
