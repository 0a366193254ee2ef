# Two commands do all set-up on a fresh machine with Python 3.11:
#   make demo   runs the main job
#   make test   runs lint (ruff, mypy --strict) and the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint format bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[test,dev,demo]"
	# verl, for the loss tests against it: apart and without its pins (transformers < 5.11, tensordict <= 0.10)
	$(BIN)/python -m pip install --quiet --no-deps --upgrade --target $(VENV)/verl "verl==0.9.1"
	touch $(STAMP)

demo: $(STAMP)
	PYTHONPATH=examples $(BIN)/python -m demo demo

test: $(STAMP) lint
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy --strict zephon_collate

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_sweep.py
	$(BIN)/python benchmarks/bench_transformers.py
	$(BIN)/python benchmarks/bench_to_training.py
	$(BIN)/python benchmarks/bench_floor.py
	$(BIN)/python benchmarks/bench_collator.py
	$(BIN)/python benchmarks/bench_transfer.py
	$(BIN)/python benchmarks/bench_packing.py
	$(BIN)/python benchmarks/bench_columnar.py
	$(BIN)/python benchmarks/bench_balance.py
	$(BIN)/python benchmarks/bench_trl.py

clean:
	rm -rf $(VENV)
