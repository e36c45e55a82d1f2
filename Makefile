# The two set-up commands of the README. Each creates .venv when missing, installs, runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cpu,exact,plot,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/oom_demo.py

test: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
