PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# The repository root holds a folder named `operator`, which would shadow the standard library's
# module if `python -m` put the working directory on sys.path.
export PYTHONSAFEPATH := 1

.PHONY: test venv serve

# The venv is rebuilt whenever the pinned requirements change.
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[runtime,operator,test]'
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q tests

# The demo model is built into ~/.cache/kvpilot on first use by `serve` itself.
serve: venv
	$(VENV)/bin/kvpilot serve --host 127.0.0.1 --port 8000
