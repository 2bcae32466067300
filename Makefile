# Every target builds .venv itself from the pinned requirements.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench bench-smoke clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m rocketstore.cli.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile  # two workers, each test file on one (its fixtures start once)

bench: $(STAMP)
	$(BIN)/rocketstore bench

bench-smoke: $(STAMP)
	$(BIN)/rocketstore bench --smoke

clean:
	rm -rf $(VENV) build dist src/*.egg-info
