# Two commands for a fresh machine (see README):
#   make demo   set up, then run the quickstart notebook headless (CPU engine + tiny model without a GPU)
#   make test   set up, then run every test (unit, integration, faults, notebooks, browser, ranks)
#   make lab    JupyterLab on 127.0.0.1:$(LAB_PORT) (a token in the URL it prints) with this .venv's kernel
#   make test-faults / test-notebooks / test-ranks / test-fleets / test-main   one suite (see tools/run_tests.sh)
# Without conda, environments live in .venv/ (kernel) and .venv-server/ (SGLang, GPU boxes only),
# built from environment-train.yml / environment-server.yml; re-running reuses what is installed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo --gpu)
RUN_DIR ?= runs/demo
NB_TIMEOUT ?= 900
LAB_PORT ?= 8888

.PHONY: demo lab test venv server-env vllm-env browser-deps test-faults test-notebooks test-ranks test-fleets test-main clean-runs

$(VENV)/.installed: environment-train.yml pyproject.toml tools/yml_requirements.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PYTHON) tools/yml_requirements.py environment-train.yml $(GPU) > $(VENV)/requirements.txt
	$(PY) -m pip install -q -r $(VENV)/requirements.txt
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "artsg_nb (.venv)" >/dev/null
	touch $@

# In a git checkout, the nbstripout filter strips outputs from notebooks/*.ipynb as they are
# committed (JupyterLab's autosave writes them into the tracked files); once per clone. The
# attributes go in .gitattributes (committed), where results notebooks are exempt.
venv: $(VENV)/.installed
	@if git rev-parse --git-dir >/dev/null 2>&1 && ! git config --get filter.nbstripout.clean >/dev/null; then \
		$(VENV)/bin/nbstripout --install --attributes .gitattributes && echo "nbstripout git filter installed: notebooks are committed without outputs"; fi

# Server environments for a GPU box without conda (conda users: environment-server.yml /
# environment-vllm.yml): `make server-env` builds .venv-server/, `make vllm-env` .venv-vllm/.
server-env: .venv-server/.installed
vllm-env: .venv-vllm/.installed
.venv-%/.installed: environment-%.yml tools/yml_requirements.py
	@test -x .venv-$*/bin/python || $(PYTHON) -m venv .venv-$*
	$(PYTHON) tools/yml_requirements.py environment-$*.yml > .venv-$*/requirements.txt
	.venv-$*/bin/pip install -q -r .venv-$*/requirements.txt
	touch $@

# Headless Chromium for the real-browser test (Debian's package; Playwright drives it).
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

demo: venv
	$(if $(GPU),$(MAKE) server-env,)
	$(PY) -m artsg_nb.demo --run-dir $(RUN_DIR)
	@echo "Open the notebooks: make lab  (JupyterLab on 127.0.0.1:$(LAB_PORT) with the .venv kernel; from another machine: ssh -L $(LAB_PORT):127.0.0.1:$(LAB_PORT) this-host)"

# The token is JupyterLab's own (printed in the URL, never on a command line other users can read).
# As root (a GPU container), JupyterLab refuses to start without --allow-root.
lab: venv
	$(PY) -m jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.port=$(LAB_PORT) --ServerApp.open_browser=False \
		--ServerApp.root_dir=$(CURDIR) --LabApp.default_url=/lab/tree/notebooks/01_quickstart.ipynb \
		$(if $(filter 0,$(shell id -u)),--allow-root,)

# Every suite runs with HOME and every cache in a fresh, empty temporary directory (a new user's
# machine: the tiny model comes from the repository, SmolLM2 is fetched again), and each suite runs
# even when another failed; the last lines are each suite's summary, the exit status 1 if any failed.
test: venv browser-deps
	PY=$(PY) NB_TIMEOUT=$(NB_TIMEOUT) SUITES_SIDE_BY_SIDE=1 tools/run_tests.sh faults+notebooks+ranks+fleets main

test-notebooks: browser-deps  # its browser test skips without chromium
test-faults test-notebooks test-ranks test-fleets test-main: test-%:
	PY=$(PY) NB_TIMEOUT=$(NB_TIMEOUT) tools/run_tests.sh $*

clean-runs:
	rm -rf runs
