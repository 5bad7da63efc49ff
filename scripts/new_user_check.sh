#!/usr/bin/env bash
# What a new user hit (issue 30), checked end to end on a tiny random model this script makes:
# every refusal exits 2 with at most three lines on stderr and no traceback, a refused training
# run keeps its files, a plain string stop is one stop string (API and CLI), and --json says why
# the text ended. Prints PASS/FAIL per case; exits 1 if any failed. No downloads.
#
# The cases run the CLI's entry point (selfspec.cli.main, what the `selfspec` script calls) in one
# process, since importing torch and transformers is most of a command's time; two of them also
# run as separate `python -m selfspec.cli` processes, to check the real exit status and stderr.
#
#   bash scripts/new_user_check.sh          # $PY, else the active venv's, the clone's .venv, or PATH's python
#   PY=/path/to/python bash scripts/new_user_check.sh
set -u
source "$(dirname "$0")/env.sh"   # $PY and $SELFSPEC
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's selfspec; tests/ for the model
export TOKENIZERS_PARALLELISM=false SELFSPEC_KERNELS=stock OMP_NUM_THREADS=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export SELFSPEC_HOME="$WORK/home"
exec "${PYTHON:-$PY}" - "$WORK" <<'EOF'
import contextlib
import hashlib
import io
import json
import random
import subprocess
import sys
import traceback
from pathlib import Path

import torch

import selfspec
from selfspec.cli import main
from tests.conftest import WORDS, save_tiny

work = Path(sys.argv[1])
failed: list[str] = []


def report(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}  ({detail.strip().splitlines()[0][:150] if detail.strip() else ''})",
          flush=True)
    if not ok:
        failed.append(name)


def cli(*argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `selfspec ARGV`, run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - a traceback is what this script looks for
            err.write(traceback.format_exc())
            code = 1
    return code, out.getvalue(), err.getvalue()


def judge(name: str, code: int, err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    problems = ([f"exit {code}, not 2"] if code != 2 else []) + \
        ([f"{len(lines)} lines on stderr"] if not 1 <= len(lines) <= 3 else []) + \
        (["a traceback"] if "Traceback" in err else []) + [f"no {n!r}" for n in needles if n not in err]
    report(name, not problems, "; ".join(problems) + (" | " + err.strip()[:300] if problems else err))


def refused(name: str, *argv: str, says: tuple[str, ...] = ()) -> None:
    judge(name, *(lambda c, o, e: (c, e))(*cli(*argv)), *says)


def in_a_process(name: str, *argv: str, says: tuple[str, ...] = ()) -> None:
    r = subprocess.run([sys.executable, "-m", "selfspec.cli", *argv], capture_output=True, text=True, timeout=300)
    judge(f"{name} [own process]", r.returncode, r.stderr, *says)


def files(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in d.rglob("*") if p.is_file()}


# -- a tiny random model and a little chat data in its words -------------------------------------------
tiny = work / "tiny"
with contextlib.redirect_stderr(io.StringIO()):
    save_tiny(tiny)
rng = random.Random(0)
data = work / "conv.jsonl"
data.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
    {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(5))},
    {"role": "assistant", "content": " ".join(WORDS[(i + j) % 12] for j in range(12))}]}) + "\n" for i in range(24)))
T = str(tiny)

# -- item 1: training into an earlier run without --resume is refused, and its files are kept -----------
run = work / "run"
train = ("train", "hass", "--model", T, "--data", str(data), "--out", str(run), "--max-len", "32", "--epochs", "1",
         "--no-progress")
code, _, err = cli(*train, "--checkpoint-every", "2")
if code != 0:
    report("1  a first training run", False, err[-300:])
else:
    before = files(run)
    refused("1  train into a finished run without --resume", *train, says=("--resume", "another --out"))
    report("1  its checkpoints and head are kept", files(run) == before and any(run.glob("train/checkpoints/*")),
           f"{len(before)} files unchanged")
    (run / "selfspec_head.json").unlink()  # as if interrupted after its last checkpoint
    (run / "train" / "history.json").unlink()
    in_a_process("1  train into an interrupted run without --resume", *train,
                 says=("pass --resume to continue it", "another --out"))

# -- item 2: a plain string stop is one stop string, in the API and the CLI -----------------------------
g = selfspec.load(T, "ar")
full = g.generate("w3 w4 w5", max_new_tokens=12, chat=False, ignore_eos=True)
stop = full.text.split()[3]
one = g.generate("w3 w4 w5", max_new_tokens=12, chat=False, ignore_eos=True, stop=stop)
listed = g.generate("w3 w4 w5", max_new_tokens=12, chat=False, ignore_eos=True, stop=[stop])
report(f"2  API stop={stop!r} is one stop string", one.text == listed.text != "" and one.finish_reason == "stop",
       f"text {one.text!r}")
code, out, err = cli("generate", "--model", T, "--no-chat", "--method", "ar", "--max-new-tokens", "12", "--json",
                     "--stop", stop, "w3 w4 w5")
stopped = json.loads(out) if code == 0 else {}
report(f"2  CLI --stop {stop} is one stop string", stopped.get("text") == listed.text, f"text {stopped.get('text')!r}")

# -- --json: finish_reason (stop / length) and kernels ---------------------------------------------------
code, out, err = cli("generate", "--model", T, "--no-chat", "--method", "ar", "--max-new-tokens", "4", "--json",
                     "w3 w4 w5")
cut = json.loads(out) if code == 0 else {}
report("   --json finish_reason and kernels", (stopped.get("finish_reason"), cut.get("finish_reason"),
                                               cut.get("kernels")) == ("stop", "length", "stock"),
       f"at a stop string {stopped.get('finish_reason')!r}, at --max-new-tokens {cut.get('finish_reason')!r}, "
       f"kernels {cut.get('kernels')!r}")

# -- item 4: a device this machine lacks ------------------------------------------------------------------
if torch.backends.mps.is_available():
    print("SKIP  4  --device mps (this machine has MPS)")
else:
    in_a_process("4  generate --device mps without MPS", "generate", "--model", T, "--device", "mps", "--no-chat",
                 "w1", says=("MPS",))
refused("4  an unknown --device names auto", "generate", "--model", T, "--device", "tpu", "--no-chat", "w1",
        says=("use auto, cpu",))

# -- item 5: an --out that cannot be created (like /etc/passwd/x), before any model loads -----------------
(work / "a-file").write_text("")
bad = str(work / "a-file" / "x")
refused("5  bench --out that cannot be created", "bench", "--model", T, "--methods", "ar", "--limit", "1",
        "--out", bad, says=(f"--out {bad}",))
refused("5  export --out that cannot be created", "export", str(work / "no-head"), "--model", T, "--engine", "vllm",
        "--out", bad, says=(f"--out {bad}",))
refused("5  train --out that cannot be created", "train", "hass", "--model", T, "--data", str(data), "--out", bad,
        "--no-progress", says=(f"--out {bad}",))
refused("5  tune --out that cannot be created", "tune", "--model", T, "--out", bad + ".json",
        says=(f"--out {bad}.json",))

# -- item 6: a .gguf that is not GGUF --------------------------------------------------------------------
(work / "fake.gguf").write_text("not a GGUF file\n")
refused("6  a .gguf that is not GGUF", "generate", "--model", str(work / "fake.gguf"), "--no-chat", "w1",
        says=("is not a GGUF file",))

# -- --threads 0 -----------------------------------------------------------------------------------------
refused("   generate --threads 0", "generate", "--model", T, "--threads", "0", "--no-chat", "w1", says=("--threads",))
refused("   train --threads 0", "train", "hass", "--model", T, "--out", str(work / "t0"), "--threads", "0",
        says=("--threads",))

print(f"\n{'all cases passed' if not failed else f'{len(failed)} case(s) failed'}")
sys.exit(1 if failed else 0)
EOF
