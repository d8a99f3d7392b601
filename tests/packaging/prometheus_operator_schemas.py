"""The Prometheus Operator's schemas for its kinds (ServiceMonitor, PodMonitor, PrometheusRule), as
the npm package @kubernetes-models/prometheus-operator compiles them from the operator's CRDs into
validators: installed once into .cache/ with npm, and run with node. They check types, enums,
patterns and required fields; like the CRDs, they let unknown fields through.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from cached_tool import fetch_once
from crd_validation import REPO

PACKAGE = "@kubernetes-models/prometheus-operator@6.0.0"
CACHE = REPO / ".cache" / "kubernetes-models-prometheus-operator-6.0.0"
FETCH_TIMEOUT = 300
RUN_TIMEOUT = 60
# Reads manifests (JSON) on stdin; prints, for each, the list of what its kind's schema finds wrong.
_CHECK = """
import { readFileSync } from "node:fs";
const v1 = "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1";
const kinds = {};
for (const kind of ["ServiceMonitor", "PodMonitor", "PrometheusRule"]) {
  kinds[kind] = (await import(`${v1}/${kind}`))[kind];
}
const found = JSON.parse(readFileSync(0, "utf8")).map((manifest) => {
  if (!(manifest.kind in kinds)) return [`no schema here for ${manifest.kind}`];
  try {
    new kinds[manifest.kind](manifest).validate();
    return [];
  } catch (error) {
    return [error.message];
  }
});
console.log(JSON.stringify(found));
"""


def fetch_checker() -> Path:
    return fetch_once(CACHE / "check.mjs", CACHE, _unpack)


def _unpack(scratch: Path) -> Path:
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"npm is needed to fetch {PACKAGE}; install Node.js")
    unpacked = scratch / "unpacked"
    # npm checks every tarball against the registry's integrity hash.
    done = subprocess.run([npm, "install", "--prefix", str(unpacked), "--no-audit", "--no-fund", "--silent", PACKAGE],
                          capture_output=True, text=True, timeout=FETCH_TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"npm install {PACKAGE} failed:\n{done.stderr}")
    (unpacked / "check.mjs").write_text(_CHECK)
    return unpacked


def errors(manifests: list[dict[str, Any]]) -> list[list[str]]:
    """What the Prometheus Operator's schema of each manifest's kind finds wrong with it."""
    node = shutil.which("node")
    if node is None:
        raise RuntimeError("node is needed to run the Prometheus Operator's schemas; install Node.js")
    done = subprocess.run([node, str(fetch_checker())], input=json.dumps(manifests), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
