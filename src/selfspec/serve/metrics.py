"""The server's metrics in the Prometheus text format (version 0.0.4), names as vLLM's.

Counters end in ``_total``; every name has the ``selfspec:`` prefix. Thread-safe: the decode
worker updates them, the event loop renders them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

PREFIX = "selfspec:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

HELP = {
    "spec_decode_num_drafts": ("counter", "Decode steps that verified a draft (a step with no draft is not counted)."),
    "spec_decode_num_draft_tokens": ("counter", "Draft tokens proposed: the depth of each verified draft (a tree "
                                                "counts its depth, the tokens it can add at most)."),
    "spec_decode_num_accepted_tokens": ("counter", "Draft tokens accepted by the target."),
    "spec_decode_num_accepted_tokens_per_pos": ("counter", "Draft tokens accepted, by their position in the draft "
                                                           "(0 = the first token after the pending one)."),
    "prompt_tokens": ("counter", "Prompt tokens of the requests decoded."),
    "generation_tokens": ("counter", "Tokens generated."),
    "requests": ("counter", "Completion requests answered, by HTTP status (499: the client went away)."),
    "request_success": ("counter", "Completion requests that finished, by finish reason."),
    "time_to_first_token_seconds": ("histogram", "Seconds from a request's arrival to its first generated token "
                                                 "(queueing included)."),
    "time_per_output_token_seconds": ("histogram", "Seconds per generated token after the first, per request."),
    "e2e_request_latency_seconds": ("histogram", "Seconds from a request's arrival to its last token."),
    "num_requests_waiting": ("gauge", "Requests in the queue, not yet decoding."),
    "num_requests_running": ("gauge", "Requests decoding (0 or 1: one at a time)."),
    "model_ready": ("gauge", "1 once the model is loaded and the server takes requests."),
}
BUCKETS = {"time_to_first_token_seconds": TTFT_BUCKETS, "time_per_output_token_seconds": TPOT_BUCKETS,
           "e2e_request_latency_seconds": E2E_BUCKETS}


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    esc = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in labels)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(labels, esc)) + "}"


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    v = float(v)
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


class Metrics:
    """Counters, gauges and histograms keyed by name and labels."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple], float] = {}
        self._hist: dict[str, tuple[list[int], list[float]]] = {n: ([0] * (len(b) + 1), [0.0]) for n, b in
                                                                 BUCKETS.items()}
        for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                     "prompt_tokens", "generation_tokens", "num_requests_waiting", "num_requests_running",
                     "model_ready"):
            self._values[(name, ())] = 0

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._values[key] = self._values.get(key, 0) + value

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._values[(name, ())] = value

    def observe(self, name: str, value: float) -> None:
        bounds = BUCKETS[name]
        with self._lock:
            counts, total = self._hist[name]
            i = next((i for i, b in enumerate(bounds) if value <= b), len(bounds))
            counts[i] += 1
            total[0] += value

    def get(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._values.get((name, tuple(sorted(labels.items()))), 0)

    def record_step(self, drafted: int, accepted_positions: Sequence[int], committed: int) -> None:
        """One decode step: ``drafted`` the draft's depth (0: no draft), ``accepted_positions[d]``
        1 where the draft token at position d was accepted, ``committed`` the tokens kept."""
        with self._lock:
            v = self._values
            if drafted:
                v[("spec_decode_num_drafts", ())] += 1
                v[("spec_decode_num_draft_tokens", ())] += drafted
            for pos, n in enumerate(accepted_positions):
                if n:
                    v[("spec_decode_num_accepted_tokens", ())] += n
                    key = ("spec_decode_num_accepted_tokens_per_pos", (("position", str(pos)),))
                    v[key] = v.get(key, 0) + n
            v[("generation_tokens", ())] += committed

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        with self._lock:
            values = dict(self._values)
            hist = {n: (list(c), t[0]) for n, (c, t) in self._hist.items()}
        lines: list[str] = []
        for name, (kind, text) in HELP.items():
            full = PREFIX + name + ("_total" if kind == "counter" else "")
            lines.append(f"# HELP {full} {text}")
            lines.append(f"# TYPE {full} {kind}")
            if kind == "histogram":
                counts, total = hist[name]
                cum = 0
                for bound, c in zip((*BUCKETS[name], math.inf), counts):
                    cum += c
                    lines.append(f'{PREFIX}{name}_bucket{{le="{_num(bound)}"}} {cum}')
                lines.append(f"{PREFIX}{name}_sum {_num(total)}")
                lines.append(f"{PREFIX}{name}_count {cum}")
                continue
            rows = sorted(((labels, v) for (n, labels), v in values.items() if n == name),
                          key=lambda r: [(k, (0, int(x), "") if x.isdigit() else (1, 0, x)) for k, x in r[0]])
            for labels, v in rows:
                lines.append(f"{full}{_labels(labels)} {_num(v)}")
        return "\n".join(lines) + "\n"
