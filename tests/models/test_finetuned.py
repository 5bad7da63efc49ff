"""Bundled fine-tuned models: listed, built from the base + shipped adapter, and a clear error when
the adapter is missing."""

from __future__ import annotations

import pytest

import selfspec.models.bundled as bundled
from selfspec.cli import main
from selfspec.errors import SelfspecError


def test_listed(capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("sdsat", "space", "msn", "sft"):
        assert f"smollm2-135m-instruct-{name}" in out


def test_missing_adapter_names_the_build_command(monkeypatch, tmp_path):
    monkeypatch.setattr(bundled, "adapter_dir", lambda name: tmp_path / name)
    with pytest.raises(SelfspecError, match="scripts/train_sdsat.sh"):
        bundled.pull("smollm2-135m-instruct-sdsat")
    with pytest.raises(SelfspecError, match="scripts/train_space.sh"):
        bundled.pull("smollm2-135m-instruct-space")
    for name in ("msn", "sft"):
        with pytest.raises(SelfspecError, match="scripts/train_msn.sh"):
            bundled.pull(f"smollm2-135m-instruct-{name}")


def test_unknown_name_lists_finetuned(capsys):
    with pytest.raises(SelfspecError, match="smollm2-135m-instruct-sdsat"):
        bundled.pull("nope")
