"""`kvpilot operator`: run the kopf operator with kvpilot's handlers and a liveness endpoint."""

from __future__ import annotations

from collections.abc import Sequence

import kopf

from kvpilot.operator import handlers


def run_operator(
    *,
    namespaces: Sequence[str],
    clusterwide: bool,
    liveness_endpoint: str | None,
    metrics_endpoint: str | None,
    log_level: str,
    log_format: str,
) -> None:
    """Run until SIGTERM/SIGINT. Watches `namespaces`, or every namespace when `clusterwide`."""
    kopf.configure(
        debug=log_level == "debug",
        quiet=log_level == "warning",
        log_format=kopf.LogFormat[log_format.upper()],
    )
    kopf.run(
        registry=handlers.registry,
        # No peering objects to create or read: run one replica, with the Recreate strategy,
        # so that two operators never overlap.
        standalone=True,
        namespaces=list(namespaces),
        clusterwide=clusterwide,
        liveness_endpoint=liveness_endpoint,
        memo=kopf.Memo(metrics_endpoint=metrics_endpoint),
    )
