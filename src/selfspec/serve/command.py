"""``selfspec serve``'s own flags and its entry point (the model and method flags are
``selfspec generate``'s, added by the CLI). Importing this module imports no optional package."""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import SelfspecError, missing_dependency

if TYPE_CHECKING:
    from ..generator import SpeculativeGenerator

API_KEY_ENV = "SELFSPEC_API_KEY"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 for every interface: "
                        "set an API key then)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one, printed)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health (default ${API_KEY_ENV}; "
                        "none: no key)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: --model as given)")
    p.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait besides those decoding (default 16); beyond it: 429 with Retry-After")
    p.add_argument("--max-batch", type=int, default=None,
                   help="requests that decode at once, their steps packed into one forward (continuous batching; "
                        "default: as many as a quarter of the free memory holds whole-context KV caches for, at most "
                        "16; 1: one at a time). Exact to each request's solo run on the onednn and int8 kernels; "
                        "the compiled kernels decode one at a time")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds a request may decode; it then ends with finish_reason length (default 300)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="max_tokens of requests that send none (default 256, capped by the context)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="larger request bodies get 413 (default 1 MiB)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level (default info; debug also logs every request)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning for listening beyond this machine without an API key, else None."""
    if api_key or is_loopback(host):
        return None
    return (f"selfspec serve: warning: listening on {host} without an API key: anyone who can reach this port can "
            f"use the model; pass --api-key KEY or set ${API_KEY_ENV}")


def run_serve(args: argparse.Namespace, load: Callable[[], SpeculativeGenerator]) -> int:
    """``selfspec serve``: check the flags, then serve what ``load()`` returns."""
    if not 0 <= args.port <= 65535:
        raise SelfspecError(f"--port must be in [0, 65535], not {args.port}")
    if args.max_queue < 0:
        raise SelfspecError(f"--max-queue must be >= 0, not {args.max_queue}")
    if args.max_batch is not None and args.max_batch < 1:
        raise SelfspecError(f"--max-batch must be at least 1, not {args.max_batch}")
    if not args.request_timeout > 0:
        raise SelfspecError(f"--request-timeout must be > 0 seconds, not {args.request_timeout}")
    if args.max_tokens < 1:
        raise SelfspecError(f"--max-tokens must be at least 1, not {args.max_tokens}")
    if args.max_body_bytes < 1024:
        raise SelfspecError(f"--max-body-bytes must be at least 1024, not {args.max_body_bytes}")
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    key = key or None
    for package in ("fastapi", "uvicorn"):
        try:
            __import__(package)
        except ImportError:
            raise missing_dependency(package, "serve", "selfspec serve") from None
    from .server import ServeOptions, serve

    opts = ServeOptions(model=args.model, host=args.host, port=args.port, api_key=key,
                        served_model_name=args.served_model_name, max_queue=args.max_queue, max_batch=args.max_batch,
                        request_timeout=args.request_timeout, default_max_tokens=args.max_tokens,
                        max_body_bytes=args.max_body_bytes, log_level=args.log_level)
    return serve(opts, load, exposure_warning(args.host, key))
