"""The public API: ``selfspec.load(..., threads=N)``."""

import pytest
import torch

import selfspec
from selfspec.errors import SelfspecError


def test_load_takes_a_thread_count_and_restores_torch_s(tiny_dir):
    """On a busy machine one thread can be many times faster than torch's default; the API had no
    way to say so. The generator decodes on its threads and leaves the caller's as they were."""
    torch.set_num_threads(2)
    try:
        g = selfspec.load(str(tiny_dir), "pld", threads=1, k=3, auto_k=False)
        assert g.threads == 1 and torch.get_num_threads() == 2
        seen = {torch.get_num_threads() for _ in g.stream("w1 w2 w3", max_new_tokens=6, chat=False)}
        assert seen == {1} and torch.get_num_threads() == 2
        r = g.generate("w1 w2 w3", max_new_tokens=6, chat=False)
        assert torch.get_num_threads() == 2
        assert r.token_ids == selfspec.load(str(tiny_dir), "ar").generate("w1 w2 w3", max_new_tokens=6,
                                                                           chat=False).token_ids
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("threads", [0, -2, 1.5, True])
def test_a_bad_thread_count_is_one_line(tiny_dir, threads):
    with pytest.raises(SelfspecError, match="threads must be an integer >= 1"):
        selfspec.load(str(tiny_dir), "ar", threads=threads)
