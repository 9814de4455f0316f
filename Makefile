VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SOURCES := pyproject.toml $(wildcard packages/*/pyproject.toml) scripts/install.sh

.PHONY: demo test lint clean

$(STAMP): $(SOURCES)
	bash scripts/install.sh $(VENV)

demo: $(STAMP)  # ninfer-serve on the embedded default model; DEMO_ARGS go to ninfer-serve
	$(PY) -m ninfer_serve.demo $(DEMO_ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check packages tests scripts
	$(PY) -m pytest -n 2 --dist worksteal -q

lint: $(STAMP)
	$(VENV)/bin/ruff check packages tests scripts

clean:
	rm -rf $(VENV) out/*.ninfer
