"""``selfspec bench --concurrency`` (serve/concurrency.py) on the tiny chat model: ``selfspec serve``
in a process of its own driven by the OpenAI client at two concurrencies, every request's text its solo run's, the
transformers peer beside it, a vLLM that cannot start reported as failed (never as a figure)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import selfspec
from selfspec.errors import SelfspecError
from selfspec.kernels.onednn import available as onednn_available
from selfspec.serve.concurrency import ConcurrencyOptions, parse_levels, percentile, run_concurrency

NO_ONEDNN = onednn_available(torch.device("cpu"), torch.float32)
PROMPTS = ("w5 w6", "w7", "w8 w9 w5", "w6 w6 w7 w8")


def test_levels_and_percentiles():
    assert parse_levels("1,2, 4,8") == (1, 2, 4, 8)
    for bad in ("", "0,2", "a", "1,-2"):
        with pytest.raises(SelfspecError, match="--concurrency"):
            parse_levels(bad)
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([1.0, 9.0], 0.95) == 9.0


@pytest.mark.skipif(NO_ONEDNN is not None, reason=str(NO_ONEDNN))
def test_the_server_under_concurrent_clients(chat_dir, tmp_path, capsys):
    """fp32 on a row-invariant backend (oneDNN): every request is its solo run, which is generate's."""
    opts = ConcurrencyOptions(levels=(1, 3), prompts=PROMPTS, max_new_tokens=6, peers=("transformers",), out=tmp_path,
                              serve_args=("--model", str(chat_dir), "--method", "pld", "--kernels", "onednn"))
    assert run_concurrency(opts, lambda: selfspec.load(str(chat_dir), "pld", kernels="onednn", self_test=False)) == 0
    rows = [json.loads(line) for line in (tmp_path / "concurrency.jsonl").read_text().splitlines()]
    ours = [r for r in rows if r["contender"].startswith("selfspec pld@onednn")]
    assert [r["concurrency"] for r in ours] == [1, 3]
    assert all(r["identical_to_solo"] == r["requests"] == len(PROMPTS) and not r["failed"] for r in ours)
    assert ours[0]["mean_batch"] == 1.0 and ours[1]["mean_batch"] > 1.0  # three clients did share forwards
    assert all(r["tok_s"] > 0 and r["tpot_p95_ms"] >= r["tpot_p50_ms"] for r in ours)
    peer = [r for r in rows if r["contender"].startswith("transformers")]
    assert [r["concurrency"] for r in peer] == [1, 3] and all(r["tok_s"] > 0 for r in peer)
    report = (tmp_path / "concurrency.md").read_text()
    assert f"`generate(do_sample=False)`: {len(PROMPTS)}/{len(PROMPTS)}" in report
    assert (tmp_path / "concurrency.png").stat().st_size > 0 and report in capsys.readouterr().out
    meta = json.loads((tmp_path / "meta.json").read_text())  # how it was made, as every result directory says
    assert meta["command"][0] == "selfspec" and meta["date"] and meta["cpu_flags"] and meta["commit"]
    assert meta["levels"] == [1, 3] and meta["peers"] == ["transformers"]


def test_a_vllm_that_cannot_start_is_a_failure_not_a_figure(chat_dir, tmp_path):
    """Our own Python has no vLLM: its server exits at once, and the report says so."""
    opts = ConcurrencyOptions(levels=(1,), prompts=PROMPTS[:2], max_new_tokens=3, peers=("vllm",),
                              vllm_python=sys.executable, out=tmp_path,
                              serve_args=("--model", str(chat_dir), "--method", "ar", "--kernels", "stock"))
    run_concurrency(opts, lambda: selfspec.load(str(chat_dir), "ar", self_test=False), model_dir=str(chat_dir))
    rows = [json.loads(line) for line in (tmp_path / "concurrency.jsonl").read_text().splitlines()]
    failed = [r for r in rows if r["contender"] == "vLLM CPU"]
    assert len(failed) == 1 and failed[0]["tok_s"] is None and "exited" in failed[0]["failed"][0]
    assert "Failures (no figures" in (tmp_path / "concurrency.md").read_text()


def test_vllm_without_its_python_is_a_one_line_error(chat_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("SELFSPEC_VLLM_PYTHON", raising=False)
    opts = ConcurrencyOptions(levels=(1,), prompts=PROMPTS, peers=("vllm",), out=tmp_path)
    with pytest.raises(SelfspecError, match="--vllm-python"):
        run_concurrency(opts, lambda: pytest.fail("loaded before the options were checked"))


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0"], "--concurrency takes"),
    (["--concurrency", "2", "--peers", "llama.cpp"], "--concurrency's peers"),
    (["--concurrency", "2", "--methods", "ar,self-spec"], "serves one method"),
])
def test_cli_refuses_bad_concurrency_options(argv, message, capsys):
    from selfspec.cli import main

    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_selfspec_server_that_cannot_start_is_a_failure_not_a_figure(chat_dir, tmp_path):
    opts = ConcurrencyOptions(levels=(1,), prompts=PROMPTS[:1], max_new_tokens=2, out=tmp_path,
                              serve_args=("--model", str(tmp_path / "no-such-model"), "--method", "ar"))
    run_concurrency(opts, lambda: selfspec.load(str(chat_dir), "ar", self_test=False))
    rows = [json.loads(line) for line in (tmp_path / "concurrency.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["tok_s"] is None and "exited" in rows[0]["failed"][0]


def test_the_bench_serves_the_configuration_it_measures():
    from selfspec.cli import build_parser
    from selfspec.cli.bench import serve_args

    args = build_parser().parse_args(["bench", "--concurrency", "1,2", "--model", "m", "--kernels", "onednn",
                                      "--threads", "2"])
    got = serve_args(args, "pld")
    assert got[:4] == ("--model", "m", "--method", "pld") and ("--kernels", "onednn") == got[4:6]
    assert "--threads" in got and got[got.index("--threads") + 1] == "2"
