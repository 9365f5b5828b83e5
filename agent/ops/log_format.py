"""``--log-format json``: one JSON object per line.

Fields: ``time``, ``level``, ``logger``, ``message``, ``node``, and, when the message names
them, ``configuration`` (``namespace/name``), ``instance`` (its name) and ``slot`` — taken
from the message's own wording ("configuration default/cams: …", "instance cams-1a2b3c …"
or "instance default/cams-1a2b3c: …", "slot cams-1a2b3c-0 …"), so every existing log line
gets them without being rewritten. Capitalised ("Configuration default/cams", "Instance
default/cams-1a2b3c") only with a namespace: a bare capitalised word is too often prose.
Messages never carry ``discoveryProperties`` values (they are resolved only to be handed to
the handler), so neither can these fields.
"""

from __future__ import annotations

import json
import logging
import re
import time

_NAME = r"[a-z0-9][-a-z0-9.]*"
_FIELDS = (
    ("configuration", re.compile(rf"\b[Cc]onfiguration ({_NAME}/{_NAME})")),
    # "instance <namespace>/<name>" first (the name, not the namespace: acceptance F9)
    ("instance", re.compile(rf"\b(?:[Ii]nstance {_NAME}/|instance )({_NAME})")),
    ("slot", re.compile(r"\bslot ([a-z0-9][-a-z0-9.]*-[0-9]+)\b")),
)


class JsonFormatter(logging.Formatter):
    """Formats records as single-line JSON objects."""

    def __init__(self, node: str) -> None:
        super().__init__()
        self.node = node

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        entry: dict[str, str] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": message,
            "node": self.node,
        }
        for name, pattern in _FIELDS:
            found = pattern.search(message)
            if found:
                entry[name] = found.group(1)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)
