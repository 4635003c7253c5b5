# The front door: `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: demo test test-fast lint bench reliability clean browser nat-tools

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: an unpinned spec would pull a multi-GB CUDA build.
$(VENV)/.torch: | $(PY)
	$(PIP) install "$(TORCH_SPEC)"
	touch $@

# The example recipe package (docs/recipes.md) too: its tests need its entry points installed.
EXAMPLE_RECIPES := examples/crowdtrain-example-recipes

$(VENV)/.installed: pyproject.toml $(EXAMPLE_RECIPES)/pyproject.toml $(VENV)/.torch
	$(PIP) install -e ".[test]" -e $(EXAMPLE_RECIPES)
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/crowdtrain demo

# The web page's tests read it in a real headless Chromium (Debian's package), installed here when this
# runs as root; elsewhere those tests fail with the command to install it.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium (for the web page's tests)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null || \
	    { apt-get update -q >/dev/null && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null; } || \
	    echo "could not install chromium; the web page's tests will fail"; \
	  else echo "no chromium: the web page's tests will fail (apt-get install -y chromium)"; fi; }

# The home routers of the NAT tests (tests/netns.py) masquerade with nftables, and the UPnP ones run
# miniupnpd: Debian's packages, installed here as root.
NAT_PACKAGES := nftables miniupnpd-nftables
nat-tools:
	@command -v nft >/dev/null 2>&1 && command -v miniupnpd >/dev/null 2>&1 || \
	{ if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing nftables and miniupnpd (for the home routers of the NAT tests)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(NAT_PACKAGES) >/dev/null || \
	    { apt-get update -q >/dev/null && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(NAT_PACKAGES) >/dev/null; } || \
	    echo "could not install $(NAT_PACKAGES); the NAT tests will fail"; \
	  else echo "no nft or miniupnpd: the NAT tests will fail (apt-get install -y $(NAT_PACKAGES))"; fi; }

test: $(VENV)/.installed browser nat-tools
	$(PY) -m pytest -q

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow"

# mypy reads the package in its installed shape, crowdtrain.<folder>, through a tree of links made afresh each
# time (it cannot follow the editable install's import hook), and its findings name the repository's files.
TYPED := build/typecheck
lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	rm -rf $(TYPED) && mkdir -p $(TYPED)/crowdtrain
	ln -s $(CURDIR)/crowdtrain/* $(CURDIR)/protocol $(CURDIR)/datasets $(CURDIR)/tracker $(CURDIR)/volunteer \
	    $(TYPED)/crowdtrain/
	$(PY) -m mypy > $(TYPED)/mypy.txt; status=$$?; \
	    sed -E 's#^$(TYPED)/crowdtrain/(protocol|datasets|tracker|volunteer)/#\1/#; s#^$(TYPED)/##' $(TYPED)/mypy.txt; \
	    exit $$status

# Each prints its figures and ratios measured side by side in one run (see docs/benchmarks.md).
bench: $(VENV)/.installed
	$(PY) bench/codecs.py
	$(PY) bench/allreduce.py
	$(PY) bench/catchup.py
	$(PY) bench/time_to_first_batch.py
	$(PY) bench/tracker_load.py
	$(PY) bench/steps.py --peers 100 300 --steps 3 --warmup 1
	$(PY) bench/startup.py

# Runs the fault scenarios and rewrites docs/reliability.md from their own records.
reliability: $(VENV)/.installed
	$(PY) bench/reliability.py

clean:
	rm -rf $(VENV) build dist *.egg-info
