"""Kubeconfig files for the router's tests, which log in to an emulated API server as a developer would."""

from __future__ import annotations

from pathlib import Path


def write_kubeconfig(folder: Path, server: str, *, namespace: str, user: str = "{}") -> Path:
    """A kubeconfig whose current context is `server` as `user` (YAML flow style), in `namespace`."""
    path = folder / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: test\n"
        f"clusters: [{{name: emulated, cluster: {{server: '{server}'}}}}]\n"
        f"users: [{{name: tester, user: {user}}}]\n"
        f"contexts: [{{name: test, context: {{cluster: emulated, user: tester, namespace: {namespace}}}}}]\n"
    )
    return path
