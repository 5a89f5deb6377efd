# A thin wrapper over CMake presets. `make test` works on a fresh Debian 12 machine as root.
.PHONY: all deps build test test-release test-asan test-tsan consumer bench demo finetune-data finetune clean

JOBS ?= $(shell nproc)
PREFIX ?= $(CURDIR)/build/install

all: build

deps:
	./scripts/install-deps.sh

# Then, like `pip install -e`, a porter-build.pth puts the build tree's Python package on the
# path of Debian's python3 and of the python3 first on PATH (README.md, "From Python").
build: deps
	cmake --preset release
	cmake --build --preset release -j $(JOBS)
	./scripts/link-python-module.sh build/release/python

test-release: build
	ctest --preset release

# The sanitizer builds compile only what the 'sanitize'-labelled suites need.
test-asan: deps
	cmake --preset asan
	cmake --build --preset asan -j $(JOBS) --target porter_sanitize_tests porter_asan_tests
	ctest --preset asan

test-tsan: deps
	cmake --preset tsan
	cmake --build --preset tsan -j $(JOBS) --target porter_sanitize_tests
	ctest --preset tsan

# Installs the release build and builds examples/consumer against it with find_package(porter).
consumer: build
	cmake --install build/release --prefix $(PREFIX)
	cmake -S examples/consumer -B build/consumer -G Ninja -DCMAKE_PREFIX_PATH=$(PREFIX)
	cmake --build build/consumer
	./build/consumer/porter_consumer

test: test-release consumer test-asan test-tsan
	@echo "make test: all suites passed"

# Trains examples/gpt-tiny-zero2.json on 2 local ranks (porter train --nproc 2 re-executes
# porter under `porter launch`): a byte-level GPT on porter's own docs and sources with ZeRO
# stage 2 over Gloo, each rank under a memory limit that the none policy would exceed, with
# checkpoints offloaded to pinned host memory (README.md, "make demo"). Runs from the
# repository root, which the config's data paths are relative to; rank 0 writes the report
# (every rank's memory), the Perfetto trace of both ranks with the copy and comm lanes, and
# rank 0's memory page of the last step (one HTML file; open it in any browser).
demo: deps
	cmake --preset release
	cmake --build --preset release -j $(JOBS) --target porter
	./build/release/cli/porter train --nproc 2 --config examples/gpt-tiny-zero2.json \
	  --report build/demo-report.json --trace build/demo-trace.json \
	  --memory-page build/demo-memory.html

# The fine-tuning example (README.md, "Fine-tuning a Hugging Face model"): a small random
# Llama checkpoint in Hugging Face's layout and BPE token shards of porter's docs (train and
# validation), both written by the repository's scripts with Python's standard library.
finetune-data: deps
	cmake --preset release
	cmake --build --preset release -j $(JOBS) --target porter
	python3 scripts/hf_reference.py init --out build/llama-small --vocab 512
	python3 scripts/write_token_shards.py docs --out build/llama-tokens --tokenizer bpe --vocab 512

# Fine-tunes it with ZeRO-2, optimizer offload and the optimal planner, reporting validation
# loss, and writes the result in Hugging Face's layout to build/llama-finetuned.
finetune:
	./build/release/cli/porter train --config examples/llama-finetune.json \
	  --save-hf build/llama-finetuned --report build/finetune-report.json

bench: build
	./build/release/bench/memory_bench --benchmark_counters_tabular=true

clean:
	rm -rf build
