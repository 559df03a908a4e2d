"""Log setup: text for people, one JSON object per line for log shippers.

In JSON, what a log call passes in ``extra={...}`` (model, code, conn, pid, uid, op,
bytes, seconds, key, path) becomes top-level keys beside ts/level/logger/msg, so a
shipper can filter on ``model`` or ``code`` without parsing the message. Text lines
keep only the message, which already says the same in words.
"""

from __future__ import annotations

import json
import logging
from typing import Any

# Every attribute a LogRecord has of its own; anything else on a record came from extra=.
_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line. (A few lines here rather than one more dependency.)"""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 6), "level": record.levelname.lower(),
                               "logger": record.name, "msg": record.getMessage()}
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRS and key not in out:  # never hide the four fields above
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)  # a Path or an enum in extra= is written as text


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
