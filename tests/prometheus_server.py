"""A real Prometheus server for the tests: Debian's `prometheus` package, fetched once into
.cache/ with `apt-get download` and unpacked with `dpkg-deb -x` (no root, nothing installed),
run on 127.0.0.1 with a scrape configuration of the test's choosing. Every wait is bounded. The
package's `promtool` checks and unit-tests the chart's alerting rules.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from cached_tool import fetch_once

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "prometheus-deb"
PACKAGE = "prometheus"
FETCH_TIMEOUT = 300  # seconds for apt-get download (about 20 MB)
STARTUP_TIMEOUT = 60


def fetch_prometheus() -> Path:
    """The prometheus binary, downloaded and unpacked on first use; later calls reuse the cache."""
    return fetch_once(CACHE / "usr" / "bin" / "prometheus", CACHE, _unpack)


def fetch_promtool() -> Path:
    return fetch_once(CACHE / "usr" / "bin" / "promtool", CACHE, _unpack)


def _unpack(scratch: Path) -> Path:
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is needed to fetch Debian's {PACKAGE} package for the Prometheus tests")
    # apt checks the file against the signed package lists.
    done = subprocess.run(["apt-get", "download", PACKAGE], cwd=scratch, capture_output=True, text=True,
                          timeout=FETCH_TIMEOUT)
    debs = list(scratch.glob(f"{PACKAGE}_*.deb"))
    if done.returncode != 0 or len(debs) != 1:
        raise RuntimeError(f"apt-get download {PACKAGE} failed (are the package lists there? "
                           f"`apt-get update` fetches them):\n{done.stdout}\n{done.stderr}")
    unpacked = scratch / "unpacked"
    subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], check=True, timeout=FETCH_TIMEOUT)
    return unpacked


@dataclass(frozen=True)
class Target:
    """A scrape target and the Kubernetes labels its ServiceMonitor scrape would give it."""

    address: str  # host:port
    namespace: str
    pod: str
    service: str
    # The pod's own labels, which a monitor's relabelings may copy (as __meta_kubernetes_pod_label_*).
    pod_labels: tuple[tuple[str, str], ...] = ()


# The labels the Prometheus Operator gives every target of a ServiceMonitor or PodMonitor.
_META = {"namespace": "__meta_kubernetes_namespace", "pod": "__meta_kubernetes_pod_name",
         "service": "__meta_kubernetes_service_name"}


def scrape_job(name: str, targets: list[Target], interval: str, *, relabelings: list[dict] = (),
               honor_labels: bool = False) -> dict:
    """Static targets relabelled as the Prometheus Operator relabels a monitor's endpoints: the
    namespace, pod and service come from __meta_kubernetes_* labels, then the monitor's own
    `relabelings` (as a ServiceMonitor spells them) apply."""
    return {
        "job_name": name,
        "scrape_interval": interval,
        "scrape_timeout": interval,
        "honor_labels": honor_labels,
        "static_configs": [
            {"targets": [t.address], "labels": {
                **{_META[label]: getattr(t, label) for label in _META},
                **{f"__meta_kubernetes_pod_label_{re.sub('[^a-zA-Z0-9_]', '_', key)}": value
                   for key, value in t.pod_labels},
            }}
            for t in targets
        ],
        "relabel_configs": [
            *({"source_labels": [source], "target_label": label} for label, source in _META.items()),
            *({"source_labels": r["sourceLabels"], "target_label": r["targetLabel"]} for r in relabelings),
        ],
    }


def scrape_config(jobs: list[dict], interval: str) -> dict:
    """A Prometheus configuration that scrapes `jobs` (scrape_job) and evaluates every `interval`."""
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval}, "scrape_configs": jobs}


class PrometheusServer:
    def __init__(self, binary: Path, workdir: Path, config: dict) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                [str(binary), f"--config.file={workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"prometheus exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        pytest.fail(f"prometheus was not ready within {STARTUP_TIMEOUT} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
