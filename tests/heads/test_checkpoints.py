"""``--head DIR`` reads an EAGLE checkpoint written by another tool (an export, or an official head
in safetensors) as it reads selfspec's own heads: the same head back, and decoding with it is
still token-identical to ``ar``."""

from __future__ import annotations

import pytest
import torch

from selfspec.errors import SelfspecError
from selfspec.heads.checkpoints import load_draft_head
from selfspec.heads.eagle import EagleHead
from selfspec.heads.eagle3 import Eagle3Head


def _random_head(head: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head.eval()


@pytest.mark.parametrize("engine", ["vllm", "sglang", "eagle"])
def test_an_exported_eagle_checkpoint_loads_through_head_and_decodes_like_ar(tiny_dir, tmp_path, engine):
    from selfspec import load
    from selfspec.heads.export import export_head
    from selfspec.models.loading import load_model

    target = load_model(str(tiny_dir))
    head = _random_head(EagleHead(target.model), 3)
    head.save(tmp_path / "h", {"target": "tiny", "method": "hass"})
    res = export_head(tmp_path / "h", target.model, engine, tmp_path / engine)
    back, meta = load_draft_head(res.out, target.model)
    assert isinstance(back, EagleHead) and meta["source"] == "checkpoint"
    assert {k: v.shape for k, v in back.state_dict().items()} == {k: v.shape for k, v in head.state_dict().items()}
    prompt, kw = "The quick brown fox", dict(max_new_tokens=24)
    ar = load(str(tiny_dir), method="ar", kernels="stock").generate(prompt, **kw)
    g = load(str(tiny_dir), method="hass", kernels="stock", head=str(res.out), total_tokens=8, backoff=False)
    got = g.generate(prompt, **kw)
    assert got.token_ids == ar.token_ids and sum(got.drafted_per_step) > 0


def test_an_exported_eagle3_checkpoint_loads_as_an_eagle3_head(tiny_dir, tmp_path):
    from selfspec.heads.export import export_head
    from selfspec.models.loading import load_model

    target = load_model(str(tiny_dir)).model
    head = _random_head(Eagle3Head(target), 4)
    head.save(tmp_path / "h", {"target": "tiny", "method": "hass"})
    res = export_head(tmp_path / "h", target, "vllm", tmp_path / "v")
    back, meta = load_draft_head(res.out, target)
    assert isinstance(back, Eagle3Head) and meta["head_arch"] == "eagle3"
    assert back.feature_layers == head.feature_layers


def test_a_directory_that_is_neither_is_one_line(tiny_dir, tmp_path):
    from selfspec.models.loading import load_model

    (tmp_path / "x").mkdir()
    with pytest.raises(SelfspecError, match="not a selfspec draft head"):
        load_draft_head(tmp_path / "x", load_model(str(tiny_dir)).model)
