"""The EAGLE head's files: save/load round trip, refusal of a head for another architecture (the
exports for vLLM / SGLang / EAGLE and back: test_export.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from selfspec.errors import SelfspecError
from selfspec.heads.eagle import EagleHead, load_head

from ..conftest import tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=4)


@pytest.fixture
def saved(tmp_path, target):
    torch.manual_seed(0)
    head = EagleHead(target)
    head.save(tmp_path / "h", {"target": "tiny", "method": "hass"})
    return head, tmp_path / "h"


def outputs(head: EagleHead, target) -> torch.Tensor:
    torch.manual_seed(1)
    feats = torch.randn(1, 5, 64)
    emb = target.get_input_embeddings()(torch.tensor([[4, 5, 6, 7, 8]]))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        return head(feats, emb, torch.arange(5)[None], mask)


def test_save_load_round_trip(saved, target):
    head, path = saved
    loaded, meta = load_head(path, target)
    assert meta["method"] == "hass" and meta["target"] == "tiny"
    assert torch.equal(outputs(head, target), outputs(loaded, target))
    names = set(load_file(str(path / "model.safetensors")))
    assert "fc.weight" in names and not any("input_layernorm" in n or "embed" in n for n in names)
    trainable = sum(p.numel() for p in head.parameters())
    h, i = 64, 128  # fc (with bias) + attention (4 q heads, 2 kv heads of 16) + MLP + post norm
    assert trainable == (2 * h * h + h) + (h * h + 2 * h * 32 + h * h) + 3 * h * i + h


def test_saved_files_share_one_mode(saved):
    """The weights get the mode of the JSON files beside them (safetensors alone leaves 0600)."""
    _, path = saved
    modes = {f.name: f.stat().st_mode & 0o777 for f in path.iterdir()}
    assert len(set(modes.values())) == 1 and modes["model.safetensors"] & 0o044, modes


def test_head_for_another_architecture_is_refused(saved):
    _, path = saved
    other = tiny_model("qwen2", seed=1)
    other.config.hidden_size = 64
    other.config.intermediate_size = 256  # another shape: refused with one line
    with pytest.raises(SelfspecError, match="another architecture"):
        load_head(path, other)


def test_cli_missing_head_errors(tiny_dir, capsys):
    from selfspec.cli import main

    # no trained head for this model: one line naming the command that makes one
    assert main(["generate", "--model", str(tiny_dir), "--method", "hass", "--no-chat", "w1 w2"]) == 2
    err = capsys.readouterr().err
    assert "no trained hass head" in err and "scripts/train_hass_long.sh" in err and err.count("\n") == 1
    assert main(["generate", "--model", str(tiny_dir), "--method", "eagle2", "--no-chat", "w1 w2"]) == 2
    assert "scripts/train_eagle2.sh" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_dir), "--method", "pld", "--head", "x", "w1"]) == 2
    assert "only used by eagle2 and hass" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["eagle2", "hass"])
def test_shipped_smollm2_heads(method):
    """`--method eagle2|hass` work out of the box on the default model: the package ships fp16 heads."""
    from safetensors import safe_open

    from selfspec.heads import find_head_dir, shipped_head_dir
    from selfspec.heads.eagle import read_meta

    d = shipped_head_dir("smollm2-135m-instruct", method)
    assert d is not None and find_head_dir("smollm2-135m-instruct", method) == d  # no user head in tests
    assert read_meta(d)["target"] == "smollm2-135m-instruct"
    weights = d / "model.safetensors"
    assert weights.stat().st_size <= 10 * 2**20
    with safe_open(str(weights), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    maps = {"d2t": "I64", "t2d": "BOOL"}  # EAGLE-3 token maps of the reduced draft vocabulary
    assert {k: v for k, v in dtypes.items() if k in maps} == {k: maps[k] for k in dtypes if k in maps}
    assert {v for k, v in dtypes.items() if k not in maps} == {"F16"}
