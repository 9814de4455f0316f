VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SOURCES := pyproject.toml $(wildcard packages/*/pyproject.toml) scripts/install.sh

.PHONY: demo test lint clean

$(STAMP): $(SOURCES)
	bash scripts/install.sh $(VENV)

demo: $(STAMP)
	$(PY) -m ninfer_convert.demo

test: $(STAMP)
	$(VENV)/bin/ruff check packages tests scripts
	$(PY) -m pytest -n 2 -q

lint: $(STAMP)
	$(VENV)/bin/ruff check packages tests scripts

clean:
	rm -rf $(VENV) out/*.ninfer
