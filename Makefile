# Every target creates .venv and installs what it needs, so each works on a fresh machine.
# torch is installed first and pinned: an unpinned torch pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: demo test test-devices fuzz bench clean

$(VENV)/.runtime: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -e .
	touch $@

# qai-hub-models: AI Hub's export code, the oracle of tests/conformance/; --no-deps, since its requirements (the
# hub client, AIMET, older transformers) are what exporting needs and its graph code does not
QAI_HUB_MODELS := qai-hub-models==0.65.0

$(VENV)/.dev: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
		|| echo "chromium could not be installed: the HTML report's browser test will skip"
	command -v jq >/dev/null || (apt-get update -qq && apt-get install -y -qq jq >/dev/null) \
		|| echo "jq could not be installed: the documentation blocks that use it (docs/bundle.md, docs/cli.md) will fail"
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,oracle,scale]'
	$(PIP) install -q --no-deps $(QAI_HUB_MODELS)
	($(PIP) install -q --no-deps aimet-torch==2.42.0 && $(PIP) install -q -e '.[aimet]') \
		|| echo "aimet-torch could not be installed: tests/test_aimet.py will skip"
	($(PIP) install -q --no-deps aimet-onnx==2.42.0 onnx2torch==1.5.15 && $(PIP) install -q -e '.[aimet-onnx]') \
		|| echo "aimet-onnx could not be installed: tests/test_onnx_quantisers.py's aimet-onnx tests will skip"
	touch $(VENV)/.runtime $@

demo: $(VENV)/.runtime
	$(VENV)/bin/refimpl info tiny-qwen3.5
	$(VENV)/bin/refimpl run tiny-qwen3.5 --input-ids 9707,11,1879,0
	$(VENV)/bin/refimpl golden --input-ids 9707,11,1879,0,315,3460,13 --convention genie --ar 4 --cl 32 \
		--decode-steps 4 --out out/demo-bundle --overwrite
	@echo "bundle: out/demo-bundle (manifest.json, input_list.txt, steps/*/{inputs,outputs,taps}/*.raw)"
	$(VENV)/bin/refimpl diff out/demo-bundle out/demo-bundle --top 3 --html out/demo-diff.html
	$(VENV)/bin/refimpl generate --prompt "The capital of France is" --max-new-tokens 8

# the linter first (pyflakes, import order, 120 columns: pyproject.toml), then
# two pytest workers on two cores: one BLAS / OpenMP thread each (oversubscribed OpenBLAS threads spin and
# slow everything down many times over); --dist loadgroup keeps the blocks of one documentation page on one worker
# (tests/test_doc_blocks.py: a page's blocks build on each other), every other test is spread as before
# refimpl's sources byte-compiled once: where PYTHONDONTWRITEBYTECODE is set (as on the developers' machine) every
# `refimpl` process the tests start would otherwise compile them again (~0.2 s a process, hundreds of processes)
test: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(PY) -m compileall -q refimpl tests
	OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadgroup -q

# the rest of the device matrix (pyproject's `device_matrix` marker): every architecture, graph form and planted fault
# on Qualcomm's HTP simulator, beside the one of each kind `make test` runs (~25 min on 2 cores; docs/testing.md)
test-devices: $(VENV)/.dev
	$(PY) -m compileall -q refimpl tests
	OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadgroup -q -m device_matrix \
		tests/e2e

# the long fuzz run (tests/fuzz): FUZZ_CASES seeded mutations of every format, each in a worker under a memory and a
# time limit; prints a table per format (ok / clean / crash / hang / memory) and exits 1 if any case crashed, hung or
# blew up; FUZZ_SAVE keeps those cases (to add to tests/fuzz/regressions.json). `make test` runs a short budget.
FUZZ_CASES ?= 10000
FUZZ_SAVE ?= fuzz-failures.json
fuzz: $(VENV)/.dev
	cd tests && OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 ../$(PY) -m fuzz --cases $(FUZZ_CASES) --save ../$(FUZZ_SAVE)

bench: $(VENV)/.dev
	$(PY) bench/forward.py
	$(PY) bench/classify.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
