"""The server's metrics, names as vLLM's, kept and rendered by ``prometheus_client`` in a registry
of the server's own (never the process-global one).

Counters end in ``_total``; every name has the ``selfspec:`` prefix. Thread-safe: the decode
worker updates them, the event loop renders them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "selfspec:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
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
    "num_requests_running": ("gauge", "Requests decoding (up to --max-batch at once)."),
    "batch_size": ("histogram", "Requests in each packed forward of the continuous batch."),
    "model_ready": ("gauge", "1 once the model is loaded and the server takes requests."),
}
LABELS = {"spec_decode_num_accepted_tokens_per_pos": ("position",), "requests": ("status",),
          "request_success": ("finished_reason",)}
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
BUCKETS = {"batch_size": BATCH_BUCKETS, "time_to_first_token_seconds": TTFT_BUCKETS,
           "time_per_output_token_seconds": TPOT_BUCKETS, "e2e_request_latency_seconds": E2E_BUCKETS}


class Metrics:
    """Counters, gauges and histograms by name (:data:`HELP`) and labels (:data:`LABELS`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        kinds = {"counter": Counter, "gauge": Gauge}
        self._m: dict[str, Counter | Gauge | Histogram] = {}
        for name, (kind, text) in HELP.items():
            labels = LABELS.get(name, ())
            if kind == "histogram":
                self._m[name] = Histogram(PREFIX + name, text, labels, buckets=BUCKETS[name], registry=self.registry)
            else:
                self._m[name] = kinds[kind](PREFIX + name, text, labels, registry=self.registry)

    def _of(self, name: str, labels: dict[str, str]):
        m = self._m[name]
        return m.labels(**labels) if labels else m

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        self._of(name, labels).inc(value)

    def set(self, name: str, value: float) -> None:
        cast(Gauge, self._m[name]).set(value)  # a gauge's name

    def observe(self, name: str, value: float) -> None:
        cast(Histogram, self._m[name]).observe(value)  # a histogram's name

    def get(self, name: str, **labels: str) -> float:
        """A counter's or gauge's value (0 where those labels never occurred)."""
        suffix = "_total" if HELP[name][0] == "counter" else ""
        return self.registry.get_sample_value(PREFIX + name + suffix, labels or None) or 0.0

    def record_step(self, drafted: int, accepted_positions: Sequence[int], committed: int) -> None:
        """One decode step: ``drafted`` the draft's depth (0: no draft), ``accepted_positions[d]``
        1 where the draft token at position d was accepted, ``committed`` the tokens kept."""
        if drafted:
            self.inc("spec_decode_num_drafts")
            self.inc("spec_decode_num_draft_tokens", drafted)
        for pos, n in enumerate(accepted_positions):
            if n:
                self.inc("spec_decode_num_accepted_tokens", n)
                self.inc("spec_decode_num_accepted_tokens_per_pos", n, position=str(pos))
        self.inc("generation_tokens", committed)

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry).decode()
