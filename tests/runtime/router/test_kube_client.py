"""The router's Kubernetes client logs in from a kubeconfig or a pod's service account."""

from __future__ import annotations

from pathlib import Path

import kmock
import pytest

from kubeconfigs import write_kubeconfig
from kvpilot.runtime.router.kube_client import KubeClient, in_cluster_login, kubeconfig_login

SLICES_URL = "/apis/discovery.k8s.io/v1/namespaces/ml/endpointslices"


@pytest.mark.asyncio
async def test_a_rotated_token_is_used_from_the_next_call_on(tmp_path: Path) -> None:
    token = tmp_path / "token"
    server = kmock.KubernetesEmulator()
    async with server, kmock.Server(server) as http:
        server.resources["discovery.k8s.io/v1/endpointslices"] = kmock.ResourceInfo(
            kind="EndpointSlice", namespaced=True, verbs={"list"})
        login = kubeconfig_login(write_kubeconfig(tmp_path, str(http.url), namespace="ml", user="{tokenFile: token}"))
        client = KubeClient(login)
        try:
            for rotated in ("first", "second"):
                token.write_text(f"{rotated}\n")
                await client.list(SLICES_URL, label_selector="kubernetes.io/service-name=qwen")
        finally:
            await client.close()
    assert [request.headers["Authorization"] for request in server] == ["Bearer first", "Bearer second"]
    assert login.namespace == "ml"


def test_in_cluster_login_reads_the_service_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "namespace").write_text("ml\n")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    login = in_cluster_login(tmp_path)
    assert login.server == "https://[fd00::1]:443"
    assert login.namespace == "ml"
    assert login.token_file == tmp_path / "token"
    assert login.ca_file == str(tmp_path / "ca.crt")
