"""The megakernel attached to the real Whisper model code (photon_core.models.whisper.model): weights
taken from WhisperWeights, cross K/V from WhisperNet.new_cache, compared with WhisperNet.decode +
logits over consecutive steps. Random weights in openai-whisper names at small dims."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

model = pytest.importorskip("photon_core.models.whisper.model")
config = pytest.importorskip("photon_core.models.whisper.config")

from photon_core.models.whisper.decoder_step import (Tiling, WhisperDecoderMegakernel,  # noqa: E402
                                                    WhisperDecoderWeights)


def _state_dict(dims, g: torch.Generator) -> dict[str, torch.Tensor]:
    d, da, m = dims.n_text_state, dims.n_audio_state, dims.n_mels

    def r(*s: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*s, generator=g) * scale

    sd = {"encoder.conv1.weight": r(da, m, 3), "encoder.conv1.bias": r(da),
          "encoder.conv2.weight": r(da, da, 3), "encoder.conv2.bias": r(da),
          "encoder.positional_embedding": r(dims.n_audio_ctx, da),
          "encoder.ln_post.weight": 1 + r(da), "encoder.ln_post.bias": r(da),
          "decoder.token_embedding.weight": r(dims.n_vocab, d),
          "decoder.positional_embedding": r(dims.n_text_ctx, d),
          "decoder.ln.weight": 1 + r(d), "decoder.ln.bias": r(d)}

    def block(p: str, w: int, cross: bool) -> None:
        attns = ("attn", "cross_attn") if cross else ("attn",)
        for a in attns:
            sd[f"{p}.{a}_ln.weight"], sd[f"{p}.{a}_ln.bias"] = 1 + r(w), r(w)
            for n in ("query", "key", "value", "out"):
                sd[f"{p}.{a}.{n}.weight"] = r(w, w, scale=w ** -0.5)
                if n != "key":  # openai-whisper's key projections have no bias
                    sd[f"{p}.{a}.{n}.bias"] = r(w)
        sd[f"{p}.mlp_ln.weight"], sd[f"{p}.mlp_ln.bias"] = 1 + r(w), r(w)
        sd[f"{p}.mlp.0.weight"], sd[f"{p}.mlp.0.bias"] = r(4 * w, w, scale=w ** -0.5), r(4 * w)
        sd[f"{p}.mlp.2.weight"], sd[f"{p}.mlp.2.bias"] = r(w, 4 * w, scale=(4 * w) ** -0.5), r(w)

    for i in range(dims.n_audio_layer):
        block(f"encoder.blocks.{i}", da, False)
    for i in range(dims.n_text_layer):
        block(f"decoder.blocks.{i}", d, True)
    return sd


@pytest.mark.parametrize("batch", [1, 2])
def test_megakernel_matches_whisper_net_decode(batch):
    dims = config.WhisperDims(n_mels=8, n_audio_ctx=10, n_audio_state=64, n_audio_head=2, n_audio_layer=1,
                              n_vocab=150, n_text_ctx=16, n_text_state=64, n_text_head=2, n_text_layer=2)
    g = torch.Generator().manual_seed(5 + batch)
    w = model.WhisperWeights(_state_dict(dims, g), dims)
    net = model.WhisperNet(w)
    features = torch.randn(batch, dims.n_audio_ctx, dims.n_audio_state, generator=g)
    cross = net.cross_kv(features)
    cache = net.new_cache(cross)
    mk = WhisperDecoderMegakernel(WhisperDecoderWeights.from_whisper(w), batch, max_len=8,
                                  enc_len=dims.n_audio_ctx, tiling=Tiling(32, 64, 16, 2, 1))
    mk.set_cross_kv(cross)
    tokens = torch.randint(0, dims.n_vocab, (batch, 1), generator=g)
    for offset in range(3):
        want = net.logits(net.decode(tokens, offset, cache))[:, 0]
        got = mk.step(tokens[:, 0], [offset] * batch).clone()
        err = ((mk.logits - want).abs().max() / want.abs().max()).item()
        assert err < 1e-4, err
        assert got.tolist() == want.argmax(-1).tolist()
        tokens = want.argmax(-1, keepdim=True)
