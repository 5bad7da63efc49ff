"""The GPU check (issue 31): does every method run on the device, stay lossless, and how much of
the cost model's ideal speedup does the loop keep there. Run by ``scripts/gpu_check.sh``.

Sections (each isolated: one that fails is reported and the next runs):

* ``env``: ``nvidia-smi``, torch / transformers / accelerate versions, the device, the commit.
* ``tests``: the tiny-model greedy-equivalence and sampling tests with ``SELFSPEC_TEST_DEVICE``
  set to the device (pytest in a subprocess; counts from its JUnit XML).
* ``halfprec``: every method on tiny random models in fp32 and bf16 on the device: the share of
  prompts whose greedy ids equal ``ar``'s in the same dtype (fp32 must be all; bf16 is a rate).
* ``speed``: random-weight models of real shapes (Qwen2.5-1.5B, Llama-3.1-8B; bf16, made on the
  device): T(q) for q = 1..64, ``ar`` against ``transformers`` ``generate``, the loop's overhead per
  step, and an oracle drafter right with a set probability (chains and a tree) against the cost
  model's ideal speedup tau * T(1) / T(q) (a free draft).
* ``train``: a few steps of ``selfspec train hass`` (EAGLE-2 and EAGLE-3 heads) and ``train sdsat``
  (LoRA) on a tiny model with bf16 autocast, each then resumed from its previous checkpoint.

``--small`` (implied by ``--device cpu``) runs the same code paths on tiny shapes in about a
minute: the CPU dry run of the default test tier (``tests/test_gpu_check.py``).
Writes ``OUT/gpu_report.json``; prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
QS_FULL = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
QS_SMALL = (1, 2, 4, 8)
PROBS = (0.5, 0.7, 0.8, 0.9)

SHAPES = {  # the configurations of the real models, random weights (no download)
    "qwen2.5-1.5b": dict(family="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         tie_word_embeddings=True, rope_theta=1e6),
    "llama-3.1-8b": dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         tie_word_embeddings=False, rope_theta=5e5),
}
SMALL_SHAPES = {
    "tiny-qwen2": dict(family="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6),
    "tiny-llama": dict(family="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=5e5),
}


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_model(shape: dict, device: str, dtype: torch.dtype, seed: int = 0, scale: float | None = None,
               synthetic: bool = False):
    """A random-init causal LM of ``shape``, built directly on ``device`` in ``dtype``.

    ``synthetic``: a model whose greedy continuation is known and robust to rounding, so that an
    oracle drafter stays aligned with it in bf16: the LM head's row j is the embedding of
    ``perm[j]`` and the attention / MLP outputs are scaled by 1e-3, so the next token after t is
    ``perm^-1(t)`` by a wide margin. Every layer still runs at full cost (same shapes and dtypes)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    s = dict(shape)
    family = s.pop("family")
    common = dict(max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0, **s)
    cfg = LlamaConfig(**common) if family == "llama" else Qwen2Config(**common, use_sliding_window=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = (LlamaForCausalLM if family == "llama" else Qwen2ForCausalLM)(cfg)
    finally:
        torch.set_default_dtype(default)
    if scale is not None:  # tiny models: larger weights give clear winners (fewer near-ties)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, scale)
    if synthetic:
        if cfg.tie_word_embeddings:
            raise ValueError("a synthetic model needs untied embeddings")
        with torch.no_grad():
            perm = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed)).to(device)
            model.lm_head.weight.copy_(model.get_input_embeddings().weight[perm])
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(1e-3)
                layer.mlp.down_proj.weight.mul_(1e-3)
    model.generation_config.eos_token_id = None  # random models: never stop early
    model.generation_config.pad_token_id = 0
    model.requires_grad_(False)
    return model.eval()


def loaded(model, name: str):
    from selfspec.models.loading import LoadedModel

    return LoadedModel(model=model, tokenizer=None, name=name, path=None).runner("stock")


def median_of(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# -- env ---------------------------------------------------------------------------------------------

def section_env(args) -> dict:
    import accelerate
    import transformers

    out: dict = {"python": platform.python_version(), "torch": torch.__version__,
                 "transformers": transformers.__version__, "accelerate": accelerate.__version__,
                 "device": args.device, "cuda_available": torch.cuda.is_available()}
    if args.device.startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out |= {"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count,
                "cuda": torch.version.cuda}
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi"], capture_output=True, text=True)
        print(r.stdout, flush=True)
        out["nvidia_smi"] = r.stdout.splitlines()[2:4] if r.stdout else r.stderr.strip()
    try:
        out["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip() or None
    except OSError:
        out["commit"] = None
    from selfspec.core.machine import cpu_flags

    out["cpu_flags"] = cpu_flags()
    return out


# -- tests ---------------------------------------------------------------------------------------------

def junit_counts(path: Path) -> dict:
    """passed / failed / errors / skipped and the failing test ids from a JUnit XML file."""
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    for case in root.iter("testcase"):
        tag = {child.tag for child in case}
        name = f"{case.get('classname')}::{case.get('name')}"
        if "failure" in tag:
            counts["failed"] += 1
            counts["failures"].append(name)
        elif "error" in tag:
            counts["errors"] += 1
            counts["failures"].append(name)
        elif "skipped" in tag:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def count_verbose(text: str) -> dict:
    """passed / failed / errors / skipped from pytest ``-v`` lines (when no JUnit XML was written)."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    for line in text.splitlines():
        for word, key in (("PASSED", "passed"), ("FAILED", "failed"), ("ERROR", "errors"), ("SKIPPED", "skipped")):
            if f" {word} " in f" {line} " and "::" in line:
                counts[key] += 1
                if key in ("failed", "errors"):
                    counts["failures"].append(line.strip()[-200:])
                break
    return counts


class BackgroundTests:
    """The tiny-model tests on the device, in a pytest subprocess that runs while the other
    correctness sections do (timing sections run after it, alone)."""

    def __init__(self, args) -> None:
        self.xml = Path(args.out) / "junit-tests.xml"
        self.log = Path(args.out) / "pytest.log"
        if args.small:  # the dry run: one test through the same plumbing (the default tier runs the rest)
            targets, marker = ["tests/drafters/test_scripted.py::test_same_seed_same_draws"], ""
        else:
            # the statistical tier first: its tree tests are the longest items on a GPU (thousands of
            # launch-bound tiny steps each), and xdist hands tests out in this order
            targets = ["tests/statistical", "tests/decoding/test_greedy_equivalence.py",
                       "tests/drafters/test_scripted.py", "tests/decoding/test_coupled_sampling.py",
                       "tests/decoding/test_host_reads.py"]
            marker = "not (slow or real_model)"
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", marker, "--junitxml",
               str(self.xml), "-rfE", "--timeout", "300", *targets]
        if args.tests_k:
            cmd += ["-k", args.tests_k]
        workers = min(12, (os.cpu_count() or 1) - 3)
        if not args.small and workers > 1:
            try:
                import xdist  # noqa: F401

                cmd += ["-n", str(workers)]
            except ImportError:
                pass
        env = {**os.environ, "SELFSPEC_TEST_DEVICE": args.device,
               "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        log(f"tests (background): {' '.join(cmd[3:])}")
        self.t0 = time.perf_counter()
        self.out = open(self.log, "w")
        # a session of its own, so a stop ends the xdist workers too (killing pytest alone left them
        # running beside the speed section: the fourth lease's run 7)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.out, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)

    def finish(self, timeout: float) -> dict:
        """Wait up to ``timeout`` seconds, then stop it; the counts (from the XML, else the log)."""
        timed_out = False
        try:
            self.proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.out.close()
        text = self.log.read_text()
        tail = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))][:30]
        print("\n".join(tail + text.splitlines()[-3:]), flush=True)
        res = junit_counts(self.xml) if self.xml.is_file() and not timed_out else count_verbose(text)
        return res | {"seconds": round(time.perf_counter() - self.t0, 1), "returncode": self.proc.returncode,
                      "timed_out": timed_out}


# -- fp32 / bf16 greedy identity of every method ---------------------------------------------------------

def method_cases(vocab: int) -> dict[str, tuple[str, dict]]:
    """Every method with options that run on a random tiny model (no head, fine-tune or download)."""
    return {
        "pld": ("pld", dict(k=4, auto_k=False)),
        "self-spec": ("self-spec", dict(skip_attention=(1,), skip_mlp=(0,), k=4, auto_k=False)),
        "self-spec-tree-none-skipped": ("self-spec", dict(skip_attention=(), skip_mlp=(), k=4, auto_k=False)),
        "eagle2-tree": ("eagle2", dict(head="random:0", total_tokens=10, top_k=3, depth=3, min_prob=0.0)),
        "hass-chain": ("hass", dict(head="random:1", total_tokens=4, top_k=1, depth=4, min_prob=0.0)),
        "eagle3-tree": ("hass", dict(head="random-eagle3:2", total_tokens=10, top_k=3, depth=3, min_prob=0.0)),
        "jacobi": ("jacobi", dict(m=4, auto_m=False)),
        "msn-tree": ("msn", dict(tree_size=12)),
        "sdsat": ("sdsat", dict(adaptive_ids=str(vocab - 1), k=3)),
        "space": ("space", dict(mask_id=vocab - 1, k=3)),
    }


def section_halfprec(args) -> dict:
    import selfspec

    vocab = 96
    shape = dict(family="llama", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e4)
    g = torch.Generator().manual_seed(0)
    n_prompts, max_new = (2, 8) if args.small else (8, 32)
    prompts = [torch.randint(4, vocab, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (n_prompts,))]
    dtypes = ["float32"] if args.small and args.device == "cpu" else ["float32", "bfloat16"]
    out: dict = {}
    for family in ("llama",) if args.small else ("llama", "qwen2"):
        for dt in dtypes:
            target = loaded(make_model({**shape, "family": family}, args.device, getattr(torch, dt), seed=3,
                                       scale=0.15), f"tiny-{family}")
            ar = selfspec.load(target, "ar", self_test=False)
            refs = [ar.generate(p, max_new_tokens=max_new, ignore_eos=True).token_ids for p in prompts]
            for case, (method, opts) in method_cases(vocab).items():
                if args.cases and case not in args.cases.split(","):
                    continue
                key = f"{case}/{family}/{dt}"
                try:
                    gen = selfspec.load(target, method, self_test=False, **opts)
                    same = sum(gen.generate(p, max_new_tokens=max_new, ignore_eos=True).token_ids == r
                               for p, r in zip(prompts, refs))
                    out[key] = {"identical": same, "prompts": len(prompts)}
                except Exception as e:  # noqa: BLE001 - one method's failure is a finding, not the end
                    out[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
                    traceback.print_exc()
    summary: dict = {}
    for dt in dtypes:
        rows = [v for k, v in out.items() if k.endswith(dt)]
        summary[dt] = {"identical": sum(v.get("identical", 0) for v in rows),
                       "prompts": sum(v.get("prompts", 0) for v in rows if "error" not in v),
                       "errors": sorted(k for k, v in out.items() if k.endswith(dt) and "error" in v)}
    return {"cases": out, "summary": summary}


# -- speed on real shapes ------------------------------------------------------------------------------

def timed_generate(gen, prompt: list[int], max_new: int, reps: int) -> tuple[list[int], float, float, float, object]:
    """Median decode tokens/s (prefill excluded) over ``reps`` runs after a warm-up, the ids,
    decode tau and the median decode seconds per step; plus the last result."""
    gen.generate(prompt, max_new_tokens=max_new, ignore_eos=True)
    rates, per_step, last = [], [], None
    for _ in range(reps):
        r = gen.generate(prompt, max_new_tokens=max_new, ignore_eos=True)
        decode_s = r.wall_s - r.prefill_s
        rates.append((r.new_tokens - 1) / decode_s)
        per_step.append(decode_s / max(1, r.steps - 1))
        last = r
    tau = (last.new_tokens - 1) / max(1, last.steps - 1)
    return last.token_ids, median_of(rates), tau, median_of(per_step), last


def hf_generate_rate(model, prompt: list[int], max_new: int, reps: int) -> tuple[list[int], float]:
    """Median tokens/s of ``generate`` (greedy, ``max_new`` tokens), prefill excluded by timing a
    1-token generate too."""
    from selfspec.core.timing import now

    dev = next(model.parameters()).device
    ids = torch.tensor([prompt], device=dev)
    att = torch.ones_like(ids)

    def once(n: int) -> tuple[torch.Tensor, float]:
        t0 = now(dev)
        o = model.generate(ids, attention_mask=att, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=0)
        return o, now(dev) - t0

    once(max_new)
    rates = []
    for _ in range(reps):
        _, t_one = once(1)
        o, t = once(max_new)
        rates.append((max_new - 1) / max(1e-9, t - t_one))
    return o[0, len(prompt):].tolist(), median_of(rates)


def best_k(prof, p: float, tree: bool, k_max: int) -> tuple[int, float]:
    """The chain depth k (tree: k wrong siblings too) with the highest ideal speedup
    tau(p, k) * T(1) / T(q) for a free draft right with probability p per token."""
    best = (1, 0.0)
    for k in range(1, k_max + 1):
        q = 2 * k + 1 if tree else k + 1
        if q > max(prof.qs):
            break
        tau = sum(p ** i for i in range(k + 1))
        ideal = tau * prof.at(1) / prof.at(q)
        if ideal > best[1]:
            best = (k, ideal)
    return best


def compiled_speed(args, shape: dict, dtype: torch.dtype, prompt: list[int], max_new: int, reps: int) -> dict:
    """Eager against the compiled static-shape step (CUDA graphs on a GPU) on ``shape`` cut to
    ``args.compiled_layers`` layers (compiling all 32 layers of the 8B shape outlasts a device
    call): ``ar`` and an oracle chain (p = 0.8) on each, tokens/s, per-step ms and ids. Inductor's
    recompile, CUDA-graph and performance-hint logs go to the log (why graphs were skipped)."""
    import selfspec
    from selfspec.core.cost import measure
    from selfspec.drafters.scripted import ScriptedDrafter

    small = {**shape, "num_hidden_layers": args.compiled_layers, "tie_word_embeddings": False}
    res: dict = {"layers": args.compiled_layers}
    target = None
    try:
        torch._logging.set_logs(recompiles=True, cudagraphs=True, perf_hints=True)
        model = make_model(small, args.device, dtype, seed=0, synthetic=True)
        target = loaded(model, f"{args.compiled_layers}-layer")
        prof = measure(model, f"gpu-check|{args.compiled_layers}-layer", qs=(1, 2, 4, 8, 16, 17, 32), context=256,
                       reps=5)
        k, _ = best_k(prof, 0.8, False, 16 if not args.small else 3)
        res |= {"T_ms": {q: round(1e3 * t, 3) for q, t in zip(prof.qs, prof.raw)}, "k": k}
        ref = None
        for kernels in ("stock", "compiled"):
            t0 = time.perf_counter()
            gen = selfspec.load(target, "ar", kernels=kernels, self_test=False)
            ids, rate, _, step, _ = timed_generate(gen, prompt, max_new, reps)
            ref = ids if ref is None else ref
            res[f"ar@{kernels}"] = {"tok_s": round(rate, 1), "step_ms": round(1e3 * step, 3),
                                    "identical": ids == ref, "seconds": round(time.perf_counter() - t0, 1)}
            gen.drafter = ScriptedDrafter(ref, k, 0, small["vocab_size"], tree=False, accept_prob=0.8, seed=0)
            t0 = time.perf_counter()
            ids, rate, tau, step, _ = timed_generate(gen, prompt, max_new, reps)
            res[f"chain@{kernels}"] = {"tok_s": round(rate, 1), "tau": round(tau, 3), "step_ms": round(1e3 * step, 3),
                                       "identical": ids == ref, "seconds": round(time.perf_counter() - t0, 1)}
            log(f"speed compiled ({args.compiled_layers} layers): ar@{kernels} {res[f'ar@{kernels}']}, "
                f"chain@{kernels} {res[f'chain@{kernels}']}")
            args.checkpoint()
            if kernels == "compiled":  # the compiled runner is the generator's own (the loaded model never changes)
                step = gen.target.step
                res["compile_s"] = ({str(s): round(v, 1) for s, v in step.compile_s.items()} if step is not None
                                    else "no compiled step on this runner")
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"[:500]
        traceback.print_exc()
    finally:
        torch._logging.set_logs()
        target = model = None
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return res


def section_speed(args, out: dict | None = None) -> dict:
    """Fills ``out`` (one entry per shape, saved by ``args.checkpoint`` after each measurement, so
    that a killed run keeps what it measured)."""
    import selfspec
    from selfspec.core.cost import measure
    from selfspec.drafters.scripted import ScriptedDrafter

    shapes = {"tiny-llama": SMALL_SHAPES["tiny-llama"]} if args.small else SHAPES
    if args.shapes and not args.small:
        shapes = {n: SHAPES[n] for n in args.shapes.split(",")}
    probs = (0.8,) if args.small else tuple(float(p) for p in args.probs.split(",")) if args.probs else PROBS
    qs = QS_SMALL if args.small else QS_FULL
    max_new, reps = (16, 1) if args.small else (128, 3)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    out = {} if out is None else out
    for name, shape in shapes.items():
        res: dict = {"dtype": str(dtype).replace("torch.", ""), "model": "synthetic (known continuation), untied"}
        out[name] = res
        try:
            log(f"speed {name}: building the model on {args.device}")
            model = make_model({**shape, "tie_word_embeddings": False}, args.device, dtype, seed=0, synthetic=True)
            target = loaded(model, name)
            prof = measure(model, f"gpu-check|{name}", qs=qs, context=256, reps=3 if args.small else 5)
            res["T_ms"] = {q: round(1e3 * t, 3) for q, t in zip(prof.qs, prof.raw)}
            res["T_ratio"] = {q: round(t / prof.raw[0], 3) for q, t in zip(prof.qs, prof.raw)}
            log(f"speed {name}: T(q) ms {res['T_ms']}")
            g = torch.Generator().manual_seed(1)
            prompt = torch.randint(4, shape["vocab_size"], (64,), generator=g).tolist()
            ar = selfspec.load(target, "ar", self_test=False)
            ref, ar_rate, _, ar_step, _ = timed_generate(ar, prompt, max_new, reps)
            hf_ids, hf_rate = hf_generate_rate(model, prompt, max_new, reps)
            same = next((i for i, (a, b) in enumerate(zip(ref, hf_ids)) if a != b), None)
            res |= {"ar_tok_s": round(ar_rate, 1), "generate_tok_s": round(hf_rate, 1),
                    "ar_vs_generate": round(ar_rate / hf_rate, 3),
                    "ar_step_ms": round(1e3 * ar_step, 3), "T1_ms": round(1e3 * prof.raw[0], 3),
                    "loop_overhead_ms_per_step": round(1e3 * (ar_step - prof.raw[0]), 3),
                    "ar_equals_generate": same is None, "first_difference": same}
            log(f"speed {name}: ar {ar_rate:.1f} tok/s, generate {hf_rate:.1f} tok/s, ids equal: {same is None}, "
                f"loop overhead {res['loop_overhead_ms_per_step']} ms/step")
            args.checkpoint()
            oracle = {}
            for tree in (False, True):
                for p in probs if not tree else (probs[0], 0.8) if len(probs) > 1 else probs:
                    k, ideal_pred = best_k(prof, p, tree, 16 if not args.small else 3)
                    ar.drafter = ScriptedDrafter(ref, k, 0, shape["vocab_size"], tree=tree, accept_prob=p, seed=0)
                    ids, rate, tau, step, last = timed_generate(ar, prompt, max_new, reps)
                    q = 2 * k + 1 if tree else k + 1
                    ideal = tau * prof.at(1) / prof.at(q)
                    measured = rate / ar_rate
                    oracle[f"{'tree' if tree else 'chain'}-p{p}"] = {
                        "k": k, "q": q, "tau": round(tau, 3), "speedup": round(measured, 3),
                        "ideal": round(ideal, 3), "kept": round(measured / ideal, 3),
                        "identical": ids == ref, "draft_ms_per_step": round(1e3 * last.draft_s / last.steps, 3)}
                    log(f"speed {name}: oracle {'tree' if tree else 'chain'} p={p} k={k}: tau {tau:.2f}, "
                        f"{measured:.2f}x ar, ideal {ideal:.2f}x, kept {measured / ideal:.2f}")
                    res["oracle"] = oracle
                    args.checkpoint()
            ar.drafter = selfspec.load(target, "ar", self_test=False).drafter
            res["oracle"] = oracle
        except Exception as e:  # noqa: BLE001
            res["error"] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc()
        finally:
            target = model = ar = None
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        if args.speed_compiled and name == list(shapes)[-1]:
            res["compiled"] = compiled_speed(args, shape, dtype, prompt, max_new, reps)
            args.checkpoint()
    return out


# -- training on the device ---------------------------------------------------------------------------

WORDS = [f"w{i}" for i in range(60)]


def save_tiny_with_tokenizer(path: Path) -> Path:
    """A tiny random Llama with a word-level tokenizer and a chat template, as a local HF directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for w in WORDS:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                     unk_token="<unk>")
    shape = dict(family="llama", vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e4)
    model = make_model(shape, "cpu", torch.float32, seed=0, scale=0.15)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path, safe_serialization=True)
    hf_tok.save_pretrained(path)
    return path


def write_data(path: Path, n: int = 32) -> Path:
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            prompt = " ".join(rng.choice(WORDS) for _ in range(5))
            answer = " ".join(WORDS[(i + j) % 12] for j in range(24))
            f.write(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": prompt},
                                                            {"role": "assistant", "content": answer}]}) + "\n")
    return path


def cli(args, argv: list[str], timeout: int = 300) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, "-m", "selfspec.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
    return r.returncode, (r.stderr or "")[-1500:]


def train_and_resume(args, name: str, argv: list[str], out: Path, resume: bool = True) -> dict:
    """Train; then drop the last checkpoint and the outputs and resume from the one before: the
    resumed run must start past step 0 and end at the same step."""
    t0 = time.perf_counter()
    rc, err = cli(args, [*argv, "--out", str(out)])
    res: dict = {"returncode": rc, "seconds": round(time.perf_counter() - t0, 1)}
    if rc != 0:
        print(err, flush=True)
        return res | {"error": err.strip().splitlines()[-1] if err.strip() else "failed"}
    hist = json.loads((out / "train" / "history.json").read_text())
    res |= {"steps": hist["step"], "first_loss": round(hist["history"][0]["loss"], 4),
            "last_loss": round(hist["history"][-1]["loss"], 4)}
    cks = sorted((out / "train" / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    if not resume:
        return res | {"resume": "not tried (--small)"}
    if len(cks) < 2:
        return res | {"resume": "skipped: fewer than 2 checkpoints"}
    shutil.rmtree(cks[-1])
    (out / "train" / "history.json").unlink()
    rc, err = cli(args, [*argv, "--out", str(out), "--resume"])
    if rc != 0:
        print(err, flush=True)
        return res | {"resume": "failed", "resume_error": err.strip().splitlines()[-1] if err.strip() else ""}
    hist2 = json.loads((out / "train" / "history.json").read_text())
    from_step = int(cks[-2].name.split("_")[1])
    ok = hist2["step"] == hist["step"] and len(hist2["history"]) == len(hist["history"])
    return res | {"resume": "ok" if ok else "mismatch", "resumed_from_step": from_step}


def section_train(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="gpu-check-train-"))
    model_dir = save_tiny_with_tokenizer(work / "tiny")
    data = write_data(work / "conv.jsonl", 16 if args.small else 32)
    mp = "no" if args.device == "cpu" else "bf16"
    common = ["--model", str(model_dir), "--data", str(data), "--max-len", "48", "--batch-size", "4",
              "--no-progress", "--device", args.device, "--mixed-precision", mp, "--checkpoint-every",
              "1" if args.small else "2"]
    runs = {
        "hass-eagle2": ["train", "hass", *common, "--epochs", "1", "--features", str(work / "feats")],
        "hass-eagle3": ["train", "hass", *common, "--epochs", "1", "--arch", "eagle3",
                        "--features", str(work / "feats3")],
        "sdsat-lora": ["train", "sdsat", *common, "--max-steps", "3" if args.small else "6", "--lora-rank", "4"],
    }
    out = {"mixed_precision": mp}
    try:
        for name, argv in runs.items():
            log(f"train {name}")
            out[name] = train_and_resume(args, name, argv, work / name, resume=not args.small or name == "hass-eagle2")
            log(f"train {name}: {out[name]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


# -- report ---------------------------------------------------------------------------------------------

def table(report: dict) -> str:
    lines = ["", "== gpu_check summary =="]
    env = report.get("env", {})
    lines.append(f"device {env.get('gpu', env.get('device'))}, torch {env.get('torch')}, transformers "
                 f"{env.get('transformers')}, commit {env.get('commit')}")
    for name, t in {"device": report.get("tests")}.items():
        if isinstance(t, dict):
            lines.append(f"tests on {name}: passed {t.get('passed')}, failed {t.get('failed')}, errors "
                         f"{t.get('errors')}, skipped {t.get('skipped')}, {t.get('seconds')} s"
                         + (" TIMED OUT" if t.get("timed_out") else ""))
    hp = (report.get("halfprec") or {}).get("summary", {})
    for dt, s in hp.items():
        lines.append(f"greedy ids equal ar ({dt}, tiny models, every method): {s['identical']}/{s['prompts']}"
                     + (f", errors in {s['errors']}" if s["errors"] else ""))
    for name, r in (report.get("speed") or {}).items():
        if "error" in r:
            lines.append(f"{name}: ERROR {r['error']}")
            continue
        t = r.get("T_ratio", {})
        lines.append(f"{name} ({r['dtype']}): T(1) {r['T1_ms']} ms, T(8)/T(1) {t.get(8, '-')}, T(64)/T(1) "
                     f"{t.get(64, '-')}; ar {r['ar_tok_s']} tok/s = {r['ar_vs_generate']}x generate "
                     f"(ids equal: {r['ar_equals_generate']}); loop overhead {r['loop_overhead_ms_per_step']} ms/step")
        for case, o in r.get("oracle", {}).items():
            lines.append(f"  oracle {case}: k {o['k']}, tau {o['tau']}, {o['speedup']}x ar, ideal {o['ideal']}x, "
                         f"kept {o['kept']}, identical {o['identical']}")
        c = r.get("compiled") or {}
        for case in ("ar", "chain"):
            e, k = c.get(f"{case}@stock"), c.get(f"{case}@compiled")
            if e and k:
                lines.append(f"  {c['layers']} layers, {case}: eager {e['step_ms']} ms/step, compiled {k['step_ms']} "
                             f"ms/step ({k['tok_s'] / e['tok_s']:.2f}x), identical {k['identical']}")
    tr = report.get("train") or {}
    for name, r in tr.items():
        if isinstance(r, dict):
            lines.append(f"train {name} ({tr.get('mixed_precision')}): rc {r.get('returncode')}, steps "
                         f"{r.get('steps')}, loss {r.get('first_loss')} -> {r.get('last_loss')}, resume "
                         f"{r.get('resume')}" + (f" ERROR {r['error']}" if "error" in r else ""))
    for sec, err in report.get("section_errors", {}).items():
        lines.append(f"section {sec} FAILED: {err}")
    return "\n".join(lines)


SECTIONS = {"env": section_env, "tests": None, "halfprec": section_halfprec, "train": section_train,
            "speed": section_speed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the dry run: small shapes)")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-check-out"), help="report directory (default $OUT)")
    p.add_argument("--small", action="store_true", help="tiny shapes (implied by --device cpu)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--tests-k", default="", help="pytest -k expression for the device tests (default: all)")
    p.add_argument("--cases", default="", help="comma-separated halfprec cases (default: all; e.g. eagle2-tree)")
    p.add_argument("--tests-budget", type=float, default=300,
                   help="seconds the background tests may take from their start (default 300)")
    p.add_argument("--shapes", default="", help=f"comma-separated speed shapes (default: all of {','.join(SHAPES)})")
    p.add_argument("--probs", default="", help="comma-separated oracle acceptance probabilities (default: "
                   f"{','.join(map(str, PROBS))})")
    p.add_argument("--speed-compiled", action=argparse.BooleanOptionalAction, default=None,
                   help="also time ar and an oracle chain on --kernels compiled (default: on for cuda)")
    p.add_argument("--compiled-layers", type=int, default=4,
                   help="layers of the last shape's model that the compiled comparison runs on (default 4)")
    args = p.parse_args(argv)
    if args.speed_compiled is None:
        args.speed_compiled = args.device.startswith("cuda")
    args.small = args.small or args.device == "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --device cpu for the dry run", file=sys.stderr)
        return 2
    wanted = args.sections.split(",")
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        print(f"gpu_check: unknown section(s) {sorted(unknown)}; choose from {','.join(SECTIONS)}", file=sys.stderr)
        return 2
    Path(args.out).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("SELFSPEC_HOME", tempfile.mkdtemp(prefix="gpu-check-home-"))
    report: dict = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "section_errors": {},
                    "seconds": {}}
    path = Path(args.out) / "gpu_report.json"

    def run(name: str, fn) -> None:
        t0 = time.perf_counter()
        log(f"section {name} ...")
        try:
            report[name] = fn()
        except Exception as e:  # noqa: BLE001 - the next section still runs
            traceback.print_exc()
            report["section_errors"][name] = f"{type(e).__name__}: {e}"[:500]
        report["seconds"][name] = round(time.perf_counter() - t0, 1)
        path.write_text(json.dumps(report, indent=1, default=str) + "\n")  # partial reports survive a kill

    if "env" in wanted:
        run("env", lambda: section_env(args))
    tests = BackgroundTests(args) if "tests" in wanted else None
    for name in ("halfprec", "train"):  # correctness: alongside the tests
        if name in wanted:
            run(name, lambda fn=SECTIONS[name]: fn(args))
    if tests is not None:
        run("tests", lambda: tests.finish(args.tests_budget - (time.perf_counter() - tests.t0)))
    if "speed" in wanted:  # timings: alone on the device
        report["speed"] = {}
        args.checkpoint = lambda: path.write_text(json.dumps(report, indent=1, default=str) + "\n")
        run("speed", lambda: section_speed(args, report["speed"]))
    print(table(report), flush=True)
    log(f"report: {path}")
    return 0 if not report["section_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
