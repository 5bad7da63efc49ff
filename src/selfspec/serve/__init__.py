"""``selfspec serve``: an OpenAI-compatible HTTP server over one :class:`~selfspec.generator.SpeculativeGenerator`.

- :mod:`.protocol`: request validation (OpenAI-style errors) and response bodies, plain Python.
- :mod:`.engine`: the one decode worker thread, its bounded queue, cancellation and time limit.
- :mod:`.metrics`: counters, gauges and histograms in the Prometheus text format.
- :mod:`.app`: the ASGI application (FastAPI): routes, API key, server-sent events.
- :mod:`.server`: uvicorn, background model loading, SIGTERM draining; :mod:`.command` its CLI flags.

Only :mod:`.app` and :mod:`.server` import the optional ``serve`` extra (``fastapi``, ``uvicorn``).
See ``docs/serving.md``.
"""
