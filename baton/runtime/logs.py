"""Logging for Baton's processes: plain text, or one JSON object per line
(`--log-format json`, python-json-logger) for a log pipeline to parse.

A line logged while a request is handled names the request: its id, and, when it is
traced, the trace and span it belongs to (as OpenTelemetry writes them: 32 and 16 hex
digits), so that the line can be joined to the trace. The gateway and the workers bind
the request in the coroutine that serves its call (`bind_request`); whatever that call
logs, in tasks it starts too, carries it. The engine thread's lines carry none: they are
the engine's, not one request's.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The request being served in this context: its id and its span (None: not traced).
_REQUEST: ContextVar[tuple[str, object | None] | None] = ContextVar("baton_request", default=None)


def bind_request(request_id: str, span=None) -> None:
    """From here on in this context (the call's task and those it starts), log lines name
    this request and, if traced, `span`."""
    _REQUEST.set((request_id, span))


class _RequestFields(logging.Filter):
    """Adds request_id, trace_id and span_id to a record logged while a request is bound
    (the JSON formatter writes every such attribute as a field)."""

    def filter(self, record: logging.LogRecord) -> bool:
        bound = _REQUEST.get()
        if bound is None:
            return True
        request_id, span = bound
        record.request_id = request_id
        context = span.get_span_context() if span is not None else None
        if context is not None and context.is_valid:
            record.trace_id = format(context.trace_id, "032x")
            record.span_id = format(context.span_id, "016x")
        return True


def configure_logging(level: str = "INFO", log_format: str = "text") -> None:
    """The root logger at `level` (a name settings checked), writing `log_format` lines to
    stderr."""
    handler = logging.StreamHandler()
    if log_format == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                                           rename_fields={"asctime": "time", "levelname": "level", "name": "logger"}))
    elif log_format == "text":
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    else:
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    handler.addFilter(_RequestFields())
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)
    if log_format == "json":
        _transformers_through_root()


def _transformers_through_root() -> None:
    """transformers writes through a handler of its own and draws progress bars (loading a
    GGUF file): in JSON mode its lines go through ours instead, and no bar is drawn, so
    that every line of stderr parses."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # a process that never loads transformers
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()
