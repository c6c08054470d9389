# Set-up and the two main jobs. Everything installs into ./.venv; nothing is assumed on the machine
# but python3 (3.11+) and pip. torch is pinned: on these machines torch==2.13.0 is the local CPU build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
MODEL ?= smollm2-135m
# vLLM (the `vllm` extra) pins other versions of some of our dependencies: it gets its own venv.
VLLM_VENV ?= .venv-vllm

.PHONY: synthetic-7b setup kernels model test-models browser llamacpp llamacpp-tools peers vllm demo lint test test-setup test-fast docs clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev,train]"
	touch $@

model: setup
	$(BIN)/leapdecode models pull $(MODEL)

# The C++ kernels, which otherwise build on first use (about two minutes on two cores, then cached).
kernels: setup
	$(PY) -c "from leapdecode.models import lean, quantize, row_exact; quantize.kernel(); row_exact.kernel(); lean.kernel()"

demo: model
	$(BIN)/leapdecode demo --model $(MODEL)

# The trace page is checked in a real headless browser: Debian's chromium (needs root for apt-get).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

# A 7B-class target without a download: Qwen2.5-7B's shapes in Q4_K_M's block types, random weights,
# the 1.5B's tokenizer (about 4.4 GB, written once; `leapdecode.bench.synthetic_gguf`).
SYNTHETIC_7B ?= $(HOME)/.cache/leapdecode/synthetic/qwen2.5-7b-shapes-q4_k_m.gguf
synthetic-7b: setup
	$(PY) -m leapdecode.bench.synthetic_gguf $(SYNTHETIC_7B) --tokenizer-from qwen2.5-coder-1.5b

# The tests also run the real draft/target pair (qwen2.5-coder-0.5b drafting for -1.5b).
test-models: model
	$(BIN)/leapdecode models pull qwen2.5-coder-0.5b
	$(BIN)/leapdecode models pull qwen2.5-coder-1.5b

# What the compiled peers build with (cmake and ninja from PyPI; a C++ compiler from the machine).
$(VENV)/.build-tools: | $(VENV)/.installed
	$(PY) -m pip install -q --disable-pip-version-check numpy nanobind==2.9.2 cmake ninja setuptools wheel
	touch $@

# llama.cpp, built once from the source in llama-cpp-python's sdist (the version the `llamacpp` extra
# pins), into the venv: its own programs as peers (`llama-cpp-spec` in the benchmark:
# llama-speculative-simple; llama-server; llama-bench) and the shared libraries the Python binding
# (the llama.cpp backend) loads. Built for this CPU (-march=native) but without AMX: on CPUs that
# have it, ggml's AMX matmul crashes (SIGSEGV in ggml_backend_amx_mul_mat) on the OpenMP threads
# torch started first. A unity build (cmake/llama-cpp-unity.cmake): about 11 minutes on two cores,
# not 24.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_TOOLS := $(VENV)/llama.cpp
LLAMA_SDIST := llama_cpp_python-0.3.36
llamacpp-tools: $(LLAMA_TOOLS)/bin/llama-speculative-simple

$(LLAMA_TOOLS)/bin/llama-speculative-simple: | $(VENV)/.build-tools
	rm -rf $(LLAMA_TOOLS) && mkdir -p $(LLAMA_TOOLS)/src
	$(PY) -m pip download -q --disable-pip-version-check --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d $(LLAMA_TOOLS)
	tar xzf $(LLAMA_TOOLS)/$(LLAMA_SDIST).tar.gz -C $(LLAMA_TOOLS)/src --strip-components=3 $(LLAMA_SDIST)/vendor/llama.cpp
	$(BIN)/cmake -S $(LLAMA_TOOLS)/src -B $(LLAMA_TOOLS)/build -G Ninja -DCMAKE_MAKE_PROGRAM=$(abspath $(BIN)/ninja) \
	  -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON \
	  -DCMAKE_UNITY_BUILD=ON -DCMAKE_PROJECT_INCLUDE=$(abspath cmake/llama-cpp-unity.cmake) \
	  "-DCMAKE_C_FLAGS=$(NO_AMX)" "-DCMAKE_CXX_FLAGS=$(NO_AMX)" >/dev/null
	$(BIN)/cmake --build $(LLAMA_TOOLS)/build -j $(shell nproc) --target llama-speculative-simple llama-server llama-bench >/dev/null
	mkdir -p $(LLAMA_TOOLS)/bin && cp $(LLAMA_TOOLS)/build/bin/llama-speculative-simple $(LLAMA_TOOLS)/build/bin/llama-server \
	  $(LLAMA_TOOLS)/build/bin/llama-bench $(LLAMA_TOOLS)/bin/

# The llama.cpp backend (an optional extra): llama-cpp-python installed from that sdist without
# compiling llama.cpp a second time (LLAMA_BUILD=OFF), the libraries built above copied into it.
llamacpp: llamacpp-tools
	@$(PY) -c "import llama_cpp" 2>/dev/null || { \
	  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $(PY) -m pip install -q --disable-pip-version-check \
	    --no-cache-dir $(LLAMA_TOOLS)/$(LLAMA_SDIST).tar.gz && \
	  lib=$$($(PY) -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llama_cpp').origin).parent / 'lib')") && \
	  mkdir -p $$lib && cp -P $(LLAMA_TOOLS)/build/bin/libllama.so* $(LLAMA_TOOLS)/build/bin/libggml*.so* $(LLAMA_TOOLS)/build/bin/libmtmd.so* $$lib/ && $(PY) -c "import llama_cpp"; }

# SuffixDecoding's own code (arctic-inference, a peer in the benchmark: `arctic-suffix`). PyPI has
# only its source, and building it in isolation would pull a CUDA torch: it is built here against
# this torch, without CUDA (about 30 s).
peers: $(VENV)/.build-tools
	@$(PY) -c "import arctic_inference.suffix_decoding" 2>/dev/null || { \
	  CMAKE_ARGS=-DPython_EXECUTABLE=$(abspath $(PY)) $(PY) -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps arctic_inference==0.3.0 -w $(VENV)/wheels && \
	  $(PY) -m pip install -q --disable-pip-version-check --no-deps $(VENV)/wheels/arctic_inference-0.3.0-*.whl; }

# leapdecode's drafters inside vLLM (`leapdecode vllm-serve`; the tests run vLLM's CPU build from
# this venv): about three minutes and 3.4 GB. PyPI's torchvision, torchaudio and torchcodec come
# in as CUDA builds that break vLLM's imports on a CPU machine, and vLLM needs none of them.
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check -e ".[vllm]"
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# ruff (lint and the format check) over the code, the tests and the scripts of docs/results; mypy
# over the package, strict on the core (engine, verifiers, drafters, methods: pyproject.toml).
lint: setup
	$(BIN)/ruff check leapdecode tests docs/results
	$(BIN)/ruff format --check leapdecode tests docs/results
	$(BIN)/mypy leapdecode/engine leapdecode/verifiers leapdecode/drafters leapdecode/methods

# The whole suite. Its set-up steps run side by side (compiling keeps the two cores busy while the
# models and vLLM download), then the tests in two pytest-xdist workers, a test file to a worker,
# one thread to a process (set before anything loads OpenMP: a thread's default comes from it).
test: test-setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

test-setup: setup
	$(MAKE) --no-print-directory -j 4 --output-sync=target lint kernels test-models browser llamacpp llamacpp-tools peers vllm

# The tiny-model tests only (under five minutes on two cores): no real model, no server or command
# on one, no optional backend, no browser, no distribution test of thousands of draws and no
# training run (`make test` runs them all); two workers, one thread each, as `test` runs them.
test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile -m "not real_model and not llamacpp and not vllm and not peers and not browser and not slow"

# The documentation site (mkdocs-material), built strictly: a broken link fails.
docs: setup
	$(BIN)/mkdocs build --strict -d site

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis
