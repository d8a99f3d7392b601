"""Where each LoRA adapter of spec.adapters lies inside an engine pod, and what the pod is given
so that it is there. Pure, like the renderers.

The pod template depends on the claims the adapters live on, never on the adapters themselves:
adding or removing an adapter leaves the pods running, and the operator loads or unloads it
through each pod's admin routes (adapter_loading.py). Three kinds of source:

- a relative path: inside the model folder (MODEL_DIR), nothing to add;
- `pvc://<claim>/<path>`: each claim mounted read-only once, under CLAIMS_DIR/<claim> (a claim
  not mounted yet is the one adapter change that rolls the pods: a running pod gains no volume);
- `hf://<org>/<repo>[@<revision>]`: downloaded by the pod's adapter-download container, which
  reads the list from the engine's ConfigMap (refreshed in running pods by the kubelet) and
  fetches what is new into DOWNLOADS_DIR/<org>/<repo>@<revision>. The operator's load fails with
  the engine's "files missing" until the download is done, and is tried again each interval.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.operator.pod_parts import CACHE_DIR, CONFIG_DIR, MODEL_DIR, Manifest, cache_env, container_security

CLAIMS_DIR = "/var/lib/kvpilot/adapters"
DOWNLOADS_DIR = f"{CACHE_DIR}/adapters"
DOWNLOADS_KEY = "adapter-downloads.txt"  # in the engine's ConfigMap: one "<repo> <revision>" a line
DOWNLOAD_POLL_SECONDS = 10
PVC, HUB = "pvc://", "hf://"
HUB_DEFAULT_REVISION = "main"


@dataclass(frozen=True)
class Source:
    """One adapter's source, parsed (the CRD has checked its form)."""

    claim: str | None = None  # pvc://
    repo: str | None = None  # hf://
    revision: str = HUB_DEFAULT_REVISION
    path: str = ""  # inside the claim or the model folder

    @classmethod
    def parse(cls, source: str) -> Source:
        if source.startswith(PVC):
            claim, _, path = source.removeprefix(PVC).partition("/")
            return cls(claim=claim, path=path)
        if source.startswith(HUB):
            repo, _, revision = source.removeprefix(HUB).partition("@")
            return cls(repo=repo, revision=revision or HUB_DEFAULT_REVISION)
        return cls(path=source)

    def pod_path(self) -> str:
        """The adapter's folder as the engine in the pod sees it."""
        if self.claim is not None:
            return f"{CLAIMS_DIR}/{self.claim}/{self.path}"
        if self.repo is not None:
            return f"{DOWNLOADS_DIR}/{self.repo}@{self.revision}"
        return f"{MODEL_DIR}/{self.path}"


def lora_enabled(spec: Mapping[str, Any]) -> bool:
    # Set, even empty, spec.adapters keeps LoRA on, so that the last adapter goes without a restart.
    return "adapters" in spec


def desired(spec: Mapping[str, Any]) -> dict[str, str]:
    """Adapter name -> its folder in the pods."""
    return {adapter["name"]: Source.parse(adapter["source"]).pod_path() for adapter in spec.get("adapters", [])}


def _sources(spec: Mapping[str, Any]) -> list[Source]:
    return [Source.parse(adapter["source"]) for adapter in spec.get("adapters", [])]


def claims(spec: Mapping[str, Any]) -> list[str]:
    return sorted({source.claim for source in _sources(spec) if source.claim is not None})


def downloads(spec: Mapping[str, Any]) -> str:
    """The adapter-download container's list: what the Hub sources need, one a line."""
    wanted = sorted({(source.repo, source.revision) for source in _sources(spec) if source.repo is not None})
    return "".join(f"{repo} {revision}\n" for repo, revision in wanted)


def volumes(spec: Mapping[str, Any]) -> list[Manifest]:
    return [{"name": _claim_volume(i), "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
            for i, claim in enumerate(claims(spec))]


def mounts(spec: Mapping[str, Any]) -> list[Manifest]:
    # Volume names are indexed, not the claim's name: a claim's name may be longer than a volume's.
    return [{"name": _claim_volume(i), "mountPath": f"{CLAIMS_DIR}/{claim}", "readOnly": True}
            for i, claim in enumerate(claims(spec))]


def _claim_volume(index: int) -> str:
    return f"adapters-{index}"


# Downloads into a scratch folder, renamed when complete: the engine never loads half a download.
_DOWNLOAD_LOOP = f"""\
while true; do
  while read -r repo revision; do
    [ -n "$repo" ] || continue
    folder="{DOWNLOADS_DIR}/$repo@$revision"
    [ -d "$folder" ] && continue
    mkdir -p "$(dirname "$folder")" && rm -rf "$folder.partial" &&
      hf download "$repo" --revision "$revision" --local-dir "$folder.partial" &&
      mv "$folder.partial" "$folder"
  done < {CONFIG_DIR}/{DOWNLOADS_KEY}
  sleep {DOWNLOAD_POLL_SECONDS}
done
"""


def download_container(engine: Mapping[str, Any]) -> Manifest:
    """The container that keeps the Hub adapters of the engine's ConfigMap downloaded, in every
    pod of an engine with LoRA on, whether or not an hf:// adapter is declared yet."""
    return {
        "name": "adapter-download",
        "image": engine["spec"]["image"],
        "command": ["sh", "-c", _DOWNLOAD_LOOP],
        "env": cache_env(),
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
        "securityContext": container_security(),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
