"""Shared fixtures: tiny random-init Llama and Qwen2 models (fp32, CPU) with a small word-level
tokenizer, saved as local HF directories, and the real SmolLM2-135M (pulled once)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Compiled-backend tests share one Inductor cache (across test processes and pytest-xdist workers,
# whose SELFSPEC_HOME differ): a graph compiled once is loaded, not compiled again, by the others.
# Set before selfspec is imported: importing it imports Inductor, which fills the variable with
# torch's own default, and the compiled backend then keeps its steps under each test session's
# SELFSPEC_HOME instead (every worker and every CI command compiled every graph again).
INDUCTOR_CACHE = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                                       os.path.join(tempfile.gettempdir(), f"selfspec-tests-inductor-{os.getuid()}"))

import pytest  # noqa: E402 - after the cache directory is set
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import selfspec.api  # noqa: E402
import selfspec.autoselect.configure  # noqa: E402
from selfspec.models import aot_step  # noqa: E402

# One torch thread per test process. Tests on tiny models run microsecond-sized ops, and a second
# OpenMP thread made each 10-20x slower whenever the 2 cores were shared (a 64-wide linear: 5 us on
# 1 thread, 1 ms on 2), which alone made the suite take 30+ minutes; SmolLM2 decodes as fast on 1
# thread as on 2 here (100 vs 96 ms a token). CI's second command runs two processes instead
# (`-n 2`). SELFSPEC_TEST_THREADS sets the threads of `real_model` and `slow` tests on bigger machines.
REAL_MODEL_THREADS = int(os.environ.get("SELFSPEC_TEST_THREADS", "1"))
torch.set_num_threads(1)
# Tests name their backend; those that test the product default (auto) unset this themselves.
os.environ["SELFSPEC_KERNELS"] = "stock"
# The device and dtype of the tiny models in the tests that honour them (greedy equivalence, the
# sampling tests): ``SELFSPEC_TEST_DEVICE=cuda`` runs them on a GPU (``scripts/gpu_check.sh``).
# The CPU-only kernels backends (onednn, int8) are skipped on other devices.
TEST_DEVICE = os.environ.get("SELFSPEC_TEST_DEVICE", "cpu")

COMPILED_OFFERED = pytest.mark.skipif(
    aot_step.route(torch.device("cpu")) is None,
    reason=f"the compiled backend is not offered on torch {torch.__version__} (models/aot_step.py KNOWN_TORCH: "
           f"{', '.join(aot_step.KNOWN_TORCH)}); the onednn runner stands in for it there, which "
           "tests/models/test_runner.py checks")
"""Tests of the compiled backend itself: skipped on a torch release whose internals the saved steps do
not know (the default tier also runs on a second torch release, docs/performance.md)."""

SAVED_ROUTE_ONLY = pytest.mark.skipif(os.environ.get("SELFSPEC_COMPILE_ROUTE", "").strip() == "public",
                                      reason="tests the saved compiled steps (models/aot_step.py), which "
                                             "SELFSPEC_COMPILE_ROUTE=public turns off")

VOCAB = 96
WORDS = [f"w{i}" for i in range(VOCAB - 4)]


def make_tokenizer(words: list[str] = WORDS) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``words`` plus <pad>, <s>, </s>, <unk> (ids 0..3)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for w in words:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def tiny_model(family: str = "llama", seed: int = 0, layers: int = 3, vocab: int = VOCAB) -> torch.nn.Module:
    """A random-init causal LM with a few layers. Weights are scaled up so that logits have
    clear winners (fewer near-ties) and greedy text is not one repeated token."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if family == "llama":
        cfg = LlamaConfig(**common)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(**common, use_sliding_window=False)
        model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def gguf_rounded(w: torch.Tensor, kind: str) -> torch.Tensor:
    """``w[N, K]`` rounded as llama.cpp quantises and dequantises it (32-weight blocks): ``Q4_1``
    (``fl32(d * q + m)``, 4-bit codes, fp16 ``d`` and ``m``) or ``Q8_0`` (``d * q``, int8 codes,
    fp16 ``d``). The fp32 weights of a model bundled from a GGUF file are such values."""
    g = w.detach().float().reshape(w.shape[0], -1, 32)
    if kind == "Q8_0":
        d = (g.abs().amax(-1, keepdim=True) / 127).half().float()
        return (torch.round(g / d).clamp(-127, 127) * d).reshape(w.shape)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    q = torch.floor((g - lo) / d + 0.5).clamp(0, 15)
    return (q * d.half().float() + lo.half().float()).reshape(w.shape)


def save_tiny(path: Path, family: str = "llama", seed: int = 0, layers: int = 3, gguf: bool = False) -> Path:
    """A :func:`tiny_model` saved with its tokenizer; with ``gguf``, its layers' weights rounded to
    Q4_1 blocks and its LM head to Q8_0 ones, as a model bundled from a GGUF file (the ``compact``
    kernels read them as such)."""
    model = tiny_model(family, seed, layers)
    if gguf:
        with torch.no_grad():
            for name, module in model.named_modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(gguf_rounded(module.weight, "Q8_0" if name == "lm_head" else "Q4_1"))
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama", 0)


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-qwen"), "qwen2", 1)


@pytest.fixture(scope="session")
def tiny_gguf_dir(tmp_path_factory) -> Path:
    """The tiny Llama with GGUF-rounded weights (Q4_1 layers, Q8_0 LM head)."""
    return save_tiny(tmp_path_factory.mktemp("tiny-llama-gguf"), "llama", 0, gguf=True)


@pytest.fixture(scope="session")
def tiny_qwen_gguf_dir(tmp_path_factory) -> Path:
    """The tiny Qwen2 (q/k/v biases) with GGUF-rounded weights."""
    return save_tiny(tmp_path_factory.mktemp("tiny-qwen-gguf"), "qwen2", 1, gguf=True)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    """Another random model with the same tokenizer: a draft that is mostly wrong."""
    return save_tiny(tmp_path_factory.mktemp("tiny-draft"), "llama", 7, layers=1)


@pytest.fixture
def refuse_loading(monkeypatch):
    """Fail the test if a model loads: for refusals that must come before loading."""
    import selfspec.api  # it binds load_model at import: import it unpatched first
    import selfspec.models.loading as loading

    def fail(*args, **kwargs):
        pytest.fail("loaded the model before refusing")

    monkeypatch.setattr(loading, "load_model", fail)
    monkeypatch.setattr(selfspec.api, "load_model", fail)


REAL_HOME = os.environ.get("SELFSPEC_HOME")
REAL_COMPILED_READY = selfspec.autoselect.configure.compiled_ready


@pytest.fixture(autouse=True)
def _auto_sees_no_saved_steps(monkeypatch):
    """``auto`` also times the compiled backend for the methods whose steps are saved here, and the
    tests' shared compile cache fills as compiled tests run: without this, a test's candidates would
    depend on which tests ran before it. Tests of that path use :data:`REAL_COMPILED_READY`."""
    monkeypatch.setattr(selfspec.autoselect.configure, "compiled_ready", lambda target, methods: [])


@pytest.fixture(scope="session", autouse=True)
def _test_home(tmp_path_factory):
    """Cost profiles measured in tests go to a temporary SELFSPEC_HOME, not the user's cache."""
    os.environ["SELFSPEC_HOME"] = str(tmp_path_factory.mktemp("selfspec-home"))
    yield
    if REAL_HOME is None:
        os.environ.pop("SELFSPEC_HOME", None)
    else:
        os.environ["SELFSPEC_HOME"] = REAL_HOME


TIER_MARKERS = ("real_model", "slow")  # the tiers allowed to load a real model (README "Tests")
_running: dict = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures (module-scoped ones load models in the first test's setup)."""
    _running["item"] = item
    real = any(item.get_closest_marker(m) for m in TIER_MARKERS)
    torch.set_num_threads(REAL_MODEL_THREADS if real else 1)  # also undoes a test's `--threads`


def bundled_path(name: str) -> str:
    """Directory of a bundled model in the user's real cache (pulled on first use). Only tests of the
    ``real_model`` or ``slow`` tier may call it: the default tier needs no real model."""
    from selfspec.models import bundled

    item = _running.get("item")
    if item is not None and not any(item.get_closest_marker(m) for m in TIER_MARKERS):
        pytest.fail(f"{item.nodeid} loads the real model {name}: mark it @pytest.mark.real_model (or slow)",
                    pytrace=False)
    test_home = os.environ["SELFSPEC_HOME"]
    if REAL_HOME is None:
        os.environ.pop("SELFSPEC_HOME")
    else:
        os.environ["SELFSPEC_HOME"] = REAL_HOME
    try:
        return str(bundled.pull(name))
    finally:
        os.environ["SELFSPEC_HOME"] = test_home


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct."""
    from selfspec.models.loading import load_model

    return load_model(bundled_path("smollm2-135m-instruct"))


def prompt_ids(seed: int, n: int, vocab: int = VOCAB) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def write_draft_ranking(model_name: str, vocab_size: int, ranking: list[int]) -> Path:
    """A draft vocabulary ranking for ``model_name`` in the test SELFSPEC_HOME (``ranking`` first,
    then every other id in order), as ``scripts/build_draft_vocab.py`` writes it."""
    from selfspec.models.draft_vocab import FORMAT, user_ranking_path
    from selfspec.train.draft_vocab import write_ranking

    rest = [i for i in range(vocab_size) if i not in set(ranking)]
    data = {"format": FORMAT, "model": model_name, "vocab_size": vocab_size, "source": {"test": True},
            "ranking": list(ranking) + rest, "counts": {}}
    return write_ranking(data, user_ranking_path(model_name))


@pytest.fixture
def int8_draft_config(tiny_dir):
    """A user skip config for the tiny model whose self-spec draft is the whole model in int8 (the
    draft that runs through a compiled step of its own), removed afterwards. Yields its path."""
    from selfspec.drafters.skip_config import SkipConfig, config_hash, user_config_path
    from selfspec.models.loading import load_model

    target = load_model(str(tiny_dir))
    path = user_config_path(target.name)
    SkipConfig(model=target.name, config_hash=config_hash(target.model), num_layers=3, skip_attention=(),
               skip_mlp=(), draft_kernels="int8").save(path)
    yield path
    path.unlink()


def pretend_draft_step_saved(target, directory: Path) -> Path:
    """Write an empty file where self-spec's int8 one-token draft step of ``target`` would be saved
    under ``directory`` (named on the compiled backend, whose attention is in the name); its path."""
    from selfspec.kernels.int8 import layer_classes
    from selfspec.models import aot_step
    from selfspec.models.compiled_step import MIN_CAPACITY

    compiled = target.runner("compiled")
    path = aot_step.artifact_paths(str(directory), compiled.model, [(1, MIN_CAPACITY, False)],
                                   linears=layer_classes(compiled.model), layout=True)[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path
