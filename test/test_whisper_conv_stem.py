"""The Whisper encoder's convolution stem builds its im2col patches from a time-major layout (a
copy in memory order, faster on CPU). Its output must be bit-identical to the channel-major
formulation it replaced (the rest of the encoder is unchanged, so the encoder output is too), and
still be Whisper's conv1d + GELU.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from photon_core.backends import reference
from photon_core.models.whisper.model import _conv_as_linear


def _channel_major_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                        stride: int) -> torch.Tensor:
    """The previous stem: [B, C, T] -> pad -> unfold -> permute -> [B, T', C*3] -> linear."""
    cols = F.pad(x, (1, 1)).unfold(2, 3, stride).permute(0, 2, 1, 3).flatten(2)
    return reference.linear(cols, weight, bias, activation="gelu")


@pytest.mark.parametrize("stride, channels, frames", [(1, 80, 3000), (2, 384, 3000), (2, 7, 9)])
def test_time_major_stem_equals_channel_major_bitwise(stride, channels, frames):
    torch.manual_seed(stride * 1000 + channels)
    x = torch.randn(2, channels, frames)
    weight, bias = torch.randn(16, channels * 3) * 0.1, torch.randn(16)

    class W:   # the _Linear fields the stem reads
        pass
    lin = W()
    lin.weight, lin.bias = weight, bias
    ours = _conv_as_linear(reference, x.transpose(1, 2), lin, stride)
    before = _channel_major_conv(x, weight, bias, stride)
    assert ours.shape == (2, (frames - 1) // stride + 1, 16)
    assert torch.equal(ours, before)
    # and it is still Whisper's convolution
    conv = F.gelu(F.conv1d(x, weight.view(16, channels, 3), bias, stride=stride, padding=1))
    torch.testing.assert_close(ours, conv.transpose(1, 2), rtol=1e-5, atol=1e-5)
