"""``--mixed-precision auto``: what it resolves to on each kind of device and CPU (timings
injected, so no test depends on this machine's speed), that timing the model leaves it as it was,
and that bf16 autocast trains to the same losses as fp32 within noise."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from selfspec.train import loop
from selfspec.train.precision import BF16_UNITS, MIN_HIDDEN, choose

from ..conftest import VOCAB, tiny_model

CPU = torch.device("cpu")
AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})


def wide_model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=MIN_HIDDEN, intermediate_size=2 * MIN_HIDDEN, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def fake_timer(fp32: float, bf16: float, reps: int = 2):
    """A clock whose passes take ``fp32`` and ``bf16`` seconds, in the order they are timed."""
    ticks, now = [], 0.0
    for _ in range(reps + 1):
        for d in (fp32, bf16):
            ticks += [now, now + d]
            now += d
    it = iter(ticks)
    return lambda: next(it)


def never():
    raise AssertionError("timed a model it should not have")


def test_an_explicit_precision_is_kept():
    for p in ("no", "bf16", "fp16"):
        assert choose(p, CPU, None, 4, 64, AMX, timer=never).precision == p


def test_a_cpu_without_bf16_units_trains_in_fp32_unmeasured():
    c = choose("auto", CPU, wide_model(), 4, 64, frozenset({"avx2", "fma", "avx512f", "avx512_vnni"}), timer=never)
    assert c.precision == "no" and "no bf16 units" in c.reason and c.seconds is None


def test_a_model_too_narrow_for_the_units_is_not_measured():
    c = choose("auto", CPU, tiny_model(), 4, 64, AMX, timer=never)
    assert c.precision == "no" and c.seconds is None


@pytest.mark.parametrize("unit", BF16_UNITS)
def test_bf16_is_chosen_only_where_clearly_faster(unit):
    flags = frozenset({"avx2", unit})
    fast = choose("auto", CPU, wide_model(), 2, 16, flags, timer=fake_timer(1.0, 0.5))
    assert fast.precision == "bf16" and fast.seconds == (1.0, 0.5) and "1000 ms in fp32" in fast.reason
    assert choose("auto", CPU, wide_model(), 2, 16, flags, timer=fake_timer(1.0, 0.95)).precision == "no"
    assert choose("auto", CPU, wide_model(), 2, 16, flags, timer=fake_timer(1.0, 1.4)).precision == "no"


def test_a_gpu_uses_bf16_where_it_has_it(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert choose("auto", cuda, None, 4, 64, frozenset(), timer=never).precision == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert choose("auto", cuda, None, 4, 64, frozenset(), timer=never).precision == "no"


def test_timing_leaves_the_model_and_the_rng_as_they_were():
    model = wide_model()
    model.lm_head.weight.requires_grad_(False)  # a frozen part stays frozen, the rest trainable
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    choose("auto", CPU, model, 2, 16, AMX)  # the real clock: whichever it picks
    assert torch.equal(torch.rand(3), expected)
    for n, p in model.named_parameters():
        assert p.grad is None and torch.equal(p, before[n])
        assert p.requires_grad == (n != "lm_head.weight")


class NextToken:
    """Next-token cross-entropy on fixed token sequences (the fine-tunes' loss, reduced)."""

    name = "lm"
    plot_keys = ("loss",)
    eval_draws = 1

    def options(self) -> dict:
        return {"lm": 1}

    def make_batch(self, batch, rng: random.Random):
        return torch.stack(batch)

    make_eval_batch = make_batch

    def loss(self, model, ids):
        logits = model(ids[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        return loss, {"loss": float(loss.detach()), "tokens": ids[:, 1:].numel()}


@pytest.fixture
def fresh_accelerate():
    """Accelerate keeps one mixed precision per process: each run here starts from a clean state,
    and the next test finds one."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def losses(tmp_path, precision: str) -> list[float]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)

    g = torch.Generator().manual_seed(0)
    base = torch.randint(4, VOCAB, (8,), generator=g)
    data = [torch.roll(base, i).repeat(3) for i in range(40)]  # a learnable cyclic pattern
    model = tiny_model()
    groups = [{"params": list(model.parameters()), "weight_decay": 0.0}]
    opts = loop.LoopOptions(epochs=3, lr=3e-3, batch_size=4, checkpoint_every=1000)
    loop.train(model, NextToken(), data, tmp_path / precision, opts, {"p": precision}, groups, lambda m, s: None,
               progress=False, accelerator=Accelerator(cpu=True, mixed_precision=precision))
    history = json.loads((tmp_path / precision / "train" / "history.json").read_text())["history"]
    return [h["loss"] for h in history]


def test_bf16_autocast_trains_to_fp32s_losses_within_noise(tmp_path, fresh_accelerate):
    """The first steps' losses under bf16 autocast follow fp32's (bf16 keeps 8 bits of mantissa:
    a few thousandths of a nat apart here), and both learn: a loss that bf16 broke would not."""
    fp32, bf16 = losses(tmp_path, "no"), losses(tmp_path, "bf16")
    assert len(fp32) == len(bf16) == 30  # 38 training items: 10 batches per epoch, 3 epochs
    assert fp32[-1] < 0.5 * fp32[0] and bf16[-1] < 0.5 * bf16[0]
    assert max(abs(a - b) for a, b in zip(fp32, bf16, strict=True)) < 0.01 * fp32[0]  # 0.007 of 4.8 nats on AVX2
