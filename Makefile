# attn-course: `make lab` starts the course, `make test` runs every test.
# Both create .venv and install everything on first use.
#
# TORCH picks the PyTorch requirement installed with the package (when .venv is first built). The
# default pin is PyPI's CPU build on macOS and Windows and its CUDA build on Linux; for the CPU wheel
# on Linux, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu (as .github/workflows/pages.yml does).
PYTHON  ?= python3
VENV    ?= .venv
TORCH   ?= torch==2.13.0
# Threads are pinned for tests and regeneration so stored notebook outputs reproduce, and claims
# are strict there: a lesson's claim that does not hold raises instead of printing its ✗ mark.
THREADS ?= 2
LAB_ARGS ?=
PYTEST_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
PINNED := OMP_NUM_THREADS=$(THREADS) MKL_NUM_THREADS=$(THREADS) ATTN_COURSE_THREADS=$(THREADS) ATTN_COURSE_STRICT_CLAIMS=1
# Stored outputs must pass on any CPU, not only on the one that regenerated them. `make regenerate`
# uses this machine's best CPU kernels; `make test` makes PyTorch and MKL take the AVX2 ones, as on
# an older laptop, so an output that only one CPU reproduces (an exact training metric, the 7th
# digit of a sum) fails here instead of on a learner's machine. On a machine whose best kernels are
# AVX2 the two runs coincide; set OTHER_KERNELS= to test with this machine's own. The library tests
# run on this machine's own kernels: forcing AVX2 on an AVX-512 CPU makes PyTorch 2.13's bfloat16
# CPU flash attention raise "pack_vnni2 is only supported when avx512 is supported" (the override
# and the hardware check disagree; a real AVX2 CPU takes another path), which is not the library's.
OTHER_KERNELS ?= ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2

.PHONY: setup lab test site site-deps regenerate runtimes exercises bench bench-peers gpu-check gpu-bundle clean

setup: $(STAMP)

# torch is named in the same pip command as the package so pip takes the pinned version
# instead of resolving `torch>=2.2` to the newest one. The extras: `lab` is JupyterLab
# (not a runtime dependency: Colab brings its own Jupyter), `dev` the test tools.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -qq "$(TORCH)" -e '.[dev,lab]'
	touch $(STAMP)

lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=. $(ROOT_FLAG) $(LAB_ARGS) notebooks/00_welcome.ipynb

# Both parts always run; the exit status is the first failure's. tests/test_site.py builds the web
# book itself, so the site's tools come first; tests/test_bench.py runs `bench peers` on tiny sizes,
# so the `bench` extra's peers come too.
BENCH_STAMP := $(VENV)/.bench-installed
test: $(STAMP) site-deps $(BENCH_STAMP)
	$(PINNED) $(BIN)/python -m pytest tests $(PYTEST_ARGS); library=$$?; \
	$(PINNED) $(OTHER_KERNELS) $(BIN)/python -m pytest notebooks solutions \
		--nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg $(PYTEST_ARGS); notebooks=$$?; \
	if [ $$library -ne 0 ]; then exit $$library; fi; exit $$notebooks

# The course as a static web book in build/site/ (open build/site/index.html), from the stored
# outputs: nothing is executed. The `site` extra is Sphinx + MyST-NB + Furo; MathJax comes from
# the npm package pinned in docs/package-lock.json and is served by the site itself.
SITE_STAMP := $(VENV)/.site-installed
site-deps: $(SITE_STAMP) docs/node_modules/.package-lock.json

$(SITE_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -qq "$(TORCH)" -e '.[dev,lab,site]'
	touch $(SITE_STAMP)

docs/node_modules/.package-lock.json: docs/package.json docs/package-lock.json
	npm ci --prefix docs --no-audit --no-fund --loglevel=error

site: site-deps
	$(BIN)/python docs/build_site.py

regenerate: $(STAMP)
	env -u ATEN_CPU_CAPABILITY -u MKL_ENABLE_INSTRUCTIONS $(PINNED) $(BIN)/attn-course regenerate

# Times every lesson and solution on this machine; rewrites notebooks/runtimes.json, 00's course map
# and every header's "Time to run".
runtimes: $(STAMP)
	$(PINNED) $(BIN)/attn-course runtimes
	$(PINNED) $(BIN)/attn-course regenerate notebooks/00_welcome.ipynb  # its checked cell reads the new file
	$(BIN)/attn-course make-exercises  # the solutions' headers changed

exercises: $(STAMP)
	$(BIN)/attn-course make-exercises

bench: $(STAMP)
	$(BIN)/attn-course bench mha

# The library against the pure-PyTorch peers from PyPI (the `bench` extra; torch named again so pip keeps the pin).
bench-peers: $(BENCH_STAMP)
	$(PINNED) $(BIN)/attn-course bench peers --threads $(THREADS)

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -qq "$(TORCH)" -e '.[dev,lab,bench]'
	touch $(BENCH_STAMP)

# On a machine with CUDA: every CUDA test case, lessons 04 and 12 and `bench mha` / `attention` / `peers` on
# the GPU, within 8 minutes, one report (GPU_REPORT, and a .json beside it). Without CUDA it says so, skips the
# GPU steps and rehearses the rest (exit 0 unless a step fails). It runs under $(PYTHON) and never builds the
# venv: a lent GPU machine has no network, and its python3 already holds a CUDA torch (tests/gpu_check.py).
GPU_REPORT ?= gpu-check-report.md
gpu-check:
	$(PYTHON) tests/gpu_check.py --report $(GPU_REPORT)

# Copy the bench extra's peers (pure Python) from the venv into .gpu-site/, which gpu-check puts on the path there.
gpu-bundle: $(STAMP)
	$(BIN)/pip install -qq "$(TORCH)" -e '.[bench]'
	$(BIN)/python tests/gpu_check.py bundle

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info docs/node_modules
