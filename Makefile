# veild — make run (demo daemon + Studio) · make test (every test) · make lint · make bench
#         make screenshots (docs/studio/*.png, taken by the browser tests)
#         make cluster-demo (PostgreSQL + Redis + two nodes on 7441/7442, docs/cluster.md)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTHON ?= python3

.PHONY: install run test lint bench screenshots cluster-demo clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/veild serve

# Two workers, a module each at a time (most tests wait on daemons, sockets and
# subprocesses, so two fill two cores); then the wall-time-bound tests alone. Both parts
# always run; either failing fails the target. TEST_WORKERS=0 runs it all in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	@if [ "$(TEST_WORKERS)" = 0 ]; then $(PY) -m pytest -q; else \
		$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial"; a=$$?; \
		$(PY) -m pytest -q -m serial; b=$$?; \
		test $$a -eq 0 && test $$b -eq 0; fi

lint: $(STAMP)
	$(VENV)/bin/ruff check daemon tests bench docs/examples examples
	$(VENV)/bin/mypy

# The peers' packages are installed here only; one that cannot install is a row that
# says so (bench/peers.py), so the install may fail without stopping the bench.
$(VENV)/.bench-installed: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]' && touch $@ \
		|| echo "bench: the peers did not install; their rows will say so"

bench: $(VENV)/.bench-installed
	$(PY) -m bench.run

# Debian's postgresql and redis-server; state in var/cluster-demo/ (removed by make clean).
cluster-demo: $(STAMP)
	$(PY) scripts/cluster_demo.py

screenshots: $(STAMP)
	VEILD_SCREENSHOTS=docs/studio $(PY) -m pytest -q tests/browser

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
