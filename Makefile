# dist_loop: the two commands a new user needs are `make train` and `make test`.
PYTHON ?= python3
VENV ?= .venv
# `make install EXTRAS=gpu,dev` takes the CUDA build of TensorFlow instead.
EXTRAS ?= cpu,dev
WORKDIR ?= runs/default
comma := ,
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: install train test check-flagfiles bench screenshots clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	@touch $@

train: install
	$(PY) -m experiments.train --flagfile=experiments/configs/default.flags --workdir=$(WORKDIR)

test: install
	$(PY) -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder tests

# Every flagfile of experiments/configs/ run as its header says, its
# `# promise:` lines checked; the table goes into docs/flagfiles.md.
# Tens of minutes of CPU: not part of `make test`.
check-flagfiles: install
	$(PY) -m tools.check_flagfiles --record=docs/flagfiles.md

bench: install
	$(PY) -m tools.bench --suite=all --out=bench.json

# The README's TensorBoard screenshot, of `make train`'s run (trained first
# if it is not there), in headless Chromium (Debian: apt-get install chromium).
screenshots: install
	@test -f $(WORKDIR)/summary.json || $(MAKE) train
	$(PY) tests/browser.py $(WORKDIR) docs/tensorboard.png

clean:
	rm -rf runs
