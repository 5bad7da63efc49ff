"""The SDPA backends decode forwards run on (``core/attention.py``)."""

import torch
from torch.nn.attention import SDPBackend

from selfspec.core.attention import decode_attention, decode_backends


def test_cuda_leaves_cudnn_out_and_keeps_the_rest():
    backends = decode_backends(torch.device("cuda", 0))
    assert SDPBackend.CUDNN_ATTENTION not in backends
    assert {SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH} <= set(backends)


def test_other_devices_keep_pytorchs_choice():
    assert decode_backends(torch.device("cpu")) is None
    assert decode_backends(None) is None


def test_the_context_sets_the_flags_for_its_duration_only():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with decode_attention(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with decode_attention(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
