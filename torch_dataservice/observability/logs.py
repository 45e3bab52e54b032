"""Log set-up for the servers: `--log-format text|json` (json: one object per line, for log
collectors), levels as `--log-level`."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (RFC 3339, UTC), level, logger, message, process,
    thread, and the exception text when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
            "thread": record.threadName,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record is emitted: a caller that swaps it
    (a test harness running the CLI in-process) must not leave the root logger writing to a
    closed stream."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def configure(level: str, log_format: str | None = None) -> None:
    """Configure the root logger for a server process (`log_format` None: the env
    TORCH_DATASERVICE_LOG_FORMAT, else text)."""
    log_format = log_format or os.environ.get("TORCH_DATASERVICE_LOG_FORMAT", "text")
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {log_format!r}")
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
