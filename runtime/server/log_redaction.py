"""Keep secrets out of the access log: it prints each request's path, and a query string can
carry a key (`?api_key=...`), so the query is never printed. Headers (Authorization) never are."""

from __future__ import annotations

import logging

ACCESS_LOGGER = "uvicorn.access"


class _DropQueryStrings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: (client, method, path with query, http version, status).
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?[query omitted]", *args[3:])
        return True


def redact_access_log() -> None:
    """Call after uvicorn has configured its loggers."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, _DropQueryStrings) for f in logger.filters):
        logger.addFilter(_DropQueryStrings())
