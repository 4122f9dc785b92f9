# edit-rt: make demo (set up, export the embedded shapes model, run the demo) | make test
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/demo.yaml
# The embedded default: the trained shapes model, committed (make train rebuilds it, ~50 min).
MODEL_DIR ?= export/models/shapes-sd
export HF_HUB_OFFLINE := 1

.PHONY: setup model export engines parity demo bench bench-engines bench-samplers bench-comfyui related serve loadtest loadtest-ray train train-looks train64 gates64 quality quality-bf16 quality-dpmpp quality-lcm demo-lcm quality-looks quality-looks2 train-looks2 quality64 sliders train-lcm train-planner plan quality-plans bench-plans train-text text bench-text check-sd15 redteam injected-bugs test test-all clean help

help:
	@echo "make demo    set up, export the embedded shapes model to ONNX, build engines, run $(CONFIG)"
	@echo "make demo-lcm the few-step demo: the LCM-LoRA as an adapter, 4-step base, 1- and 2-step edits (out/demo-lcm/)"
	@echo "make test    set up and run the test suite"
	@echo "make engines build the engines this machine can run (ONNX Runtime CPU; TensorRT with a GPU)"
	@echo "make parity  compare every graph on every built backend against PyTorch (build/<model>/parity.md)"
	@echo "make bench   edit throughput vs diffusers on the bench model (out/bench/bench.json, bench.png), then bench-samplers"
	@echo "make bench-engines  the CPU engines side by side: ort-cpu, openvino fp32 and bf16 (out/bench/engines.json)"
	@echo "make bench-samplers  the samplers at equal image quality on the shapes model (out/bench-samplers/)"
	@echo "make bench-comfyui  the ComfyUI door: N branches as one tail vs one by one, and a re-queue (out/bench-comfyui/)"
	@echo "make related near-repeat prompts served related vs exact on the shapes model (out/related/)"
	@echo "make serve   edit-rt serve $(CONFIG) (http://127.0.0.1:8188/)"
	@echo "make loadtest edits/s and p50/p95/p99 at 1, 8, 32 clients (out/loadtest/loadtest.json)"
	@echo "make loadtest-ray  the same on Ray Serve at 1 vs 2 replicas, and its routers (out/loadtest/loadtest-ray.json)"
	@echo "make quality edit success/preservation vs img2img on the shapes model (out/quality/)"
	@echo "make quality-bf16 the same with the UNet in bf16 on OpenVINO (out/quality-bf16/)"
	@echo "make quality-lcm the same for the LCM-LoRA's 4 steps, 1- and 2-step tails, vs img2img + LCMScheduler (out/quality-lcm/)"
	@echo "make train   retrain the shapes model from its seed (CPU, ~50 min on 2 cores)"
	@echo "make train-looks train issue 36's model, its scenes' looks drawn at random (CPU, pieces of 85 min; resumes)"
	@echo "make sliders train + measure the concept sliders of SLIDERS_MODEL: saturation, stroke, blur (CPU, ~25 min on 2 cores)"
	@echo "make train-lcm distil the shapes model's LCM-LoRA (4-step; CPU, 60 min in pieces of 45; resumes)"
	@echo "make train64 train the 64x64 two-object shapes model (world 2; CPU, ~70 min on 2 cores; resumes if cut)"
	@echo "make gates64 measure its gates (prompt following, oracle-mask ceiling, maps' overlap; ~15 min)"
	@echo "make quality64 make quality on it (out/quality64/)"
	@echo "make quality-looks make quality on the looks model (out/quality-looks/)"
	@echo "make train-looks2 train issue 54's model (the looks recipe, its autoencoder 3x longer; pieces of 85 min; resumes)"
	@echo "make quality-looks2 make quality on it (out/quality-looks2/)"
	@echo "make train-planner train the driving world's planner (CPU, 60 min in pieces; resumes)"
	@echo "make plan    plan configs/plan.yaml's scene: its base plan and every behaviour as one tail (out/plan/)"
	@echo "make quality-plans  the planner's plans judged on 200 scenes beside the expert's (out/quality-plans/)"
	@echo "make train-text   train the text models (masked diffusion, autoregressive; CPU, 90 min each in pieces; resumes)"
	@echo "make text         continue configs/text.yaml's prompt in 3 rows and edit a span (out/text/)"
	@echo "make bench-text   the diffusion text model vs the autoregressive one: quality, tokens/s, batches, span edits"
	@echo "make bench-plans  the plan loop's latency for 1, 8, 32 variants vs sampling from noise (out/bench-plans/)"
	@echo "make redteam issue 35's attacks replayed against a real server, /health polled (out/redteam/redteam.json)"
	@echo "make injected-bugs 16 one-line bugs, each must fail the default suite (out/injected-bugs/)"
	@echo "make test-all the test suite with the checks marked slow"
	@echo "make check-sd15  a random SD 1.5 at true size: single file, export, engines, 4 edits at 512x512 (build/check-sd15/)"
	@echo "make setup | model | export | clean"

setup: $(VENV)/.installed

# uv (pinned, by pip) installs everything, pinned by the constraints file: ~160 packages in
# seconds where pip takes about a minute. Where pip is pointed at a folder of wheels
# (PIP_FIND_LINKS: this machine's holds the CPU build of torch), uv looks there too.
$(VENV)/.installed: pyproject.toml scripts/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c scripts/constraints.txt uv
	$(BIN)/uv pip install -q --python $(BIN)/python -c scripts/constraints.txt \
	  $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) -e '.[cpu,openvino,export,test,ray]'
	touch $@

model: $(MODEL_DIR)/model_index.json

export: setup model
	$(BIN)/edit-rt export $(CONFIG)

engines: export
	$(BIN)/edit-rt engines $(CONFIG)

parity: engines
	$(BIN)/edit-rt parity $(CONFIG)

demo: engines
	$(BIN)/edit-rt run $(CONFIG)

# The few-step demo (configs/demo-lcm.yaml; `edit-rt export` converts its adapters, the LCM-LoRA among them)
demo-lcm: setup model
	$(BIN)/edit-rt export configs/demo-lcm.yaml
	$(BIN)/edit-rt engines configs/demo-lcm.yaml
	$(BIN)/edit-rt run configs/demo-lcm.yaml

serve: engines
	$(BIN)/edit-rt serve $(CONFIG)

loadtest: engines
	$(BIN)/python scripts/loadtest.py $(CONFIG)

loadtest-ray: engines
	$(BIN)/python scripts/loadtest.py $(CONFIG) --ray 1,2 --levels 16 --requests 64 --bases 8

# The shapes-world model: train it (seeded, CPU), and measure its edits.
# The committed weights came from exactly `make train` (see export/models/shapes-sd/README.md).
train: setup
	$(BIN)/python scripts/train.py --out export/models/shapes-sd --max-minutes 58

export/models/shapes-sd/model_index.json: | setup
	$(BIN)/python scripts/train.py --out export/models/shapes-sd --max-minutes 58

quality: setup export/models/shapes-sd/model_index.json
	$(BIN)/edit-rt export configs/shapes.yaml
	$(BIN)/edit-rt engines configs/shapes.yaml
	$(BIN)/edit-rt quality configs/shapes.yaml

# make quality with the UNet in bf16 on OpenVINO (issue 40; a CPU with avx512_bf16 or AMX): the same
# bases, edits and baselines as make quality (out/quality-bf16/ beside out/quality/)
quality-bf16: setup export/models/shapes-sd/model_index.json
	$(BIN)/edit-rt export configs/shapes.yaml
	$(BIN)/edit-rt quality configs/shapes-bf16.yaml

# make quality for the few-step model (issue 51): the LCM-LoRA at its 4 LCM steps, 1- and 2-step tails,
# on make quality's bases, against img2img with LCMScheduler and the LoRA (out/quality-lcm/; ~4 min).
# `edit-rt export` converts the config's adapters too (the export is configs/demo-lcm.yaml's)
quality-lcm: setup export/models/shapes-sd/model_index.json
	$(BIN)/edit-rt export configs/shapes-lcm.yaml
	$(BIN)/edit-rt engines configs/shapes-lcm.yaml
	$(BIN)/edit-rt quality configs/shapes-lcm.yaml --few-step

# make quality on DPM++ 2M Karras bases at the steps that match DDIM's 30 (docs/samplers.md)
quality-dpmpp: setup export/models/shapes-sd/model_index.json
	$(BIN)/edit-rt export configs/shapes.yaml
	$(BIN)/edit-rt engines configs/shapes.yaml
	$(BIN)/edit-rt quality configs/shapes-dpmpp.yaml --sliders without

# Issue 36's model: world 1 with every look (saturation, stroke, blur) of its training scenes drawn
# at random, so that its autoencoder keeps them (TrainSpec.looks32). Trained in pieces of at most
# 85 minutes, each resuming from the state the last one committed in export/checkpoints/shapes-looks
# (the autoencoder, the UNet's optimizer and EMA; not the 98 MB dataset, drawn again from its seed).
train-looks: setup
	$(BIN)/python scripts/train.py --preset looks --out export/models/shapes-looks-sd \
		--checkpoint export/checkpoints/shapes-looks --piece-minutes 85

# The 64x64 world-2 model (issue 26): one or two objects, VAE factor 4, cross-attention at 16x16
# and 8x8. A cut run resumes from build/train-shapes64 (its budget counting the time spent).
train64: setup
	$(BIN)/python scripts/train.py --world 2 --out export/models/shapes64-sd \
		--checkpoint build/train-shapes64 --max-minutes 120

gates64: setup
	$(BIN)/edit-rt export configs/shapes64.yaml
	$(BIN)/edit-rt gates configs/shapes64.yaml

# make quality on the looks model (out/quality-looks/), beside make quality's default model
quality-looks: setup
	$(BIN)/edit-rt export configs/shapes-looks.yaml
	$(BIN)/edit-rt engines configs/shapes-looks.yaml
	$(BIN)/edit-rt quality configs/shapes-looks.yaml

# issue 54's model (configs/shapes-looks2.yaml; out/quality-looks2/)
quality-looks2: setup
	$(BIN)/edit-rt export configs/shapes-looks2.yaml
	$(BIN)/edit-rt engines configs/shapes-looks2.yaml
	$(BIN)/edit-rt quality configs/shapes-looks2.yaml

# issue 54's model: the looks recipe, its autoencoder 12,000 steps (NEXT.md), in pieces of at most 85
# minutes each resuming from export/checkpoints/shapes-looks2
train-looks2: setup
	$(BIN)/python scripts/train.py --preset looks2 --out export/models/shapes-looks2-sd \
		--checkpoint export/checkpoints/shapes-looks2 --piece-minutes 85

quality64: setup
	$(BIN)/edit-rt export configs/shapes64.yaml
	$(BIN)/edit-rt engines configs/shapes64.yaml
	$(BIN)/edit-rt quality configs/shapes64.yaml

# Concept sliders (issues 25, 36): three LoRAs on SLIDERS_MODEL, 6 min each (pairs included), then
# measured with diffusers on 24 world bases; a cut run resumes from build/sliders-work/<model>.
SLIDERS_MODEL ?= export/models/shapes-looks-sd
sliders: setup
	$(BIN)/python scripts/train_sliders.py --model $(SLIDERS_MODEL) --out $(SLIDERS_MODEL)/sliders \
		--work build/sliders-work/$(notdir $(SLIDERS_MODEL)) --minutes-per-slider 6 --seed 0 --bases 24

# The embedded model's few-step LCM-LoRA (issue 51): each run steps for at most a piece, saves its
# state to export/checkpoints/shapes-lcm/ and resumes from it; the LoRA and its card go to lcm-lora/
train-lcm: setup
	$(BIN)/python scripts/train_lcm.py --model export/models/shapes-sd --out export/models/shapes-sd/lcm-lora \
		--checkpoint export/checkpoints/shapes-lcm --minutes 60 --piece-minutes 45 --seed 0 --bases 50

# issue 55's planner (export/world/train_planner.py): 60 minutes in all, in pieces of at most 85,
# each resuming from the committed checkpoint
train-planner: setup
	$(BIN)/python scripts/train_planner.py --out export/models/planner --checkpoint export/checkpoints/planner \
		--piece-minutes 85 --seed 0

# issue 56's text models (export/world/train_text.py): the masked-diffusion model and its
# autoregressive baseline side by side, one thread each, 90 minutes each in pieces of at most 60,
# each resuming from the committed checkpoint
train-text: setup
	OMP_NUM_THREADS=1 $(BIN)/python scripts/train_text.py --kind mdm --rope --out export/models/text-mdm \
		--checkpoint export/checkpoints/text-mdm --piece-minutes 60 & \
	OMP_NUM_THREADS=1 $(BIN)/python scripts/train_text.py --kind ar --out export/models/text-ar \
		--checkpoint export/checkpoints/text-ar --piece-minutes 60; wait

# the text model's continuations and span edit (issue 56): configs/text.yaml (out/text/)
text: setup
	$(BIN)/edit-rt export configs/text.yaml
	$(BIN)/edit-rt run configs/text.yaml

# the diffusion model against the autoregressive one on held-out files: quality, tokens per call
# and per second, 8 continuations batched, a span edit (out/bench-text/)
bench-text: setup
	$(BIN)/python -m edit_rt.export.bench.bench_text --out out/bench-text

# the planner's loop (issue 55): configs/plan.yaml's scene planned (out/plan/plans.png, plans.json)
plan: setup
	$(BIN)/edit-rt export configs/plan.yaml
	$(BIN)/edit-rt run configs/plan.yaml

# its plans judged on 200 seeded scenes at four tail lengths, beside the expert's (out/quality-plans/)
quality-plans: setup
	$(BIN)/edit-rt export configs/plan.yaml
	$(BIN)/python -m edit_rt.export.eval.quality_plans configs/plan.yaml --out out/quality-plans --scenes 200

# its latency for N = 1, 8, 32 variants: from a stored base, fresh, from noise, the expert (out/bench-plans/)
bench-plans: setup
	$(BIN)/edit-rt export configs/plan.yaml
	$(BIN)/python -m edit_rt.export.bench.bench_plans configs/plan.yaml --out out/bench-plans --repeats 20

BENCH_CONFIG ?= configs/bench.yaml
BENCH_MODEL ?= build/models/bench-sd

$(BENCH_MODEL)/model_index.json: | setup
	$(BIN)/edit-rt model --preset bench --out $(BENCH_MODEL)

bench: setup $(BENCH_MODEL)/model_index.json bench-samplers
	$(BIN)/edit-rt export $(BENCH_CONFIG)
	$(BIN)/edit-rt engines $(BENCH_CONFIG)
	$(BIN)/edit-rt bench $(BENCH_CONFIG)

# the CPU engines alone (issue 40): ort-cpu, openvino fp32 and bf16 on the bench model at N = 1, 4,
# 16, a process each (out/bench/engines.json; make bench runs it too, as bench.json's cpu_engines)
bench-engines: setup $(BENCH_MODEL)/model_index.json
	$(BIN)/edit-rt export $(BENCH_CONFIG)
	$(BIN)/python -m edit_rt.export.bench.cpu_engines $(BENCH_CONFIG) --out out/bench

# the samplers at equal image quality on the shapes model (docs/samplers.md), ~6 min on 2 cores
# The ComfyUI door's branching workflow against the same branches one by one (scripts/bench_comfyui.py)
bench-comfyui: setup export/models/shapes-sd/model_index.json
	$(BIN)/edit-rt export configs/shapes.yaml
	$(BIN)/edit-rt engines configs/shapes.yaml
	$(BIN)/python scripts/bench_comfyui.py configs/shapes.yaml --out out/bench-comfyui

bench-samplers: setup export/models/shapes-sd/model_index.json
	$(BIN)/edit-rt export configs/shapes.yaml
	$(BIN)/edit-rt engines configs/shapes.yaml
	$(BIN)/python scripts/measure_samplers.py configs/shapes.yaml --out out/bench-samplers

# related generations (issue 28) on a near-repeat prompt stream: rows saved vs quality at several
# threshold settings against a real server, and the prompt embedding's similarities (docs/related.md)
related: setup export/models/shapes-sd/model_index.json
	$(BIN)/edit-rt export configs/shapes.yaml
	$(BIN)/edit-rt engines configs/shapes.yaml
	$(BIN)/python scripts/measure_related.py configs/shapes.yaml --out out/related

# The real-size check (issue 34; docs/performance.md): time, peak RSS and disk of every stage on a
# random-weight SD 1.5 at its true size (~10 GB of RAM, 30+ minutes on 2 cores)
check-sd15: setup
	$(BIN)/python scripts/check_sd15.py --out build/check-sd15

# The suite's power: 16 one-line bugs, each applied to its own copy of HEAD, must fail the
# default suite's targeted tests (scripts/injected_bugs.py; ~3 minutes)
injected-bugs: setup
	$(BIN)/python scripts/injected_bugs.py --out out/injected-bugs

# issue 35's attacks against one real server on loopback (scripts/redteam.py; ~2 minutes)
redteam: setup export/models/shapes-sd/model_index.json
	$(BIN)/python scripts/redteam.py configs/sliders.yaml --out out/redteam

# The default run leaves out the checks marked slow (each has a fast representative in it);
# make test-all runs every test, the slow ones too (`pytest -m slow --collect-only -q` lists them).
# pytest-xdist: one worker per core, each test file whole on one worker (its module fixtures,
# its server, built once), the longest files first (tests/conftest.py); PYTEST_WORKERS=0 runs in
# this process.
# The run writes Python's bytecode caches (the venv's own __pycache__) even where the machine sets
# PYTHONDONTWRITEBYTECODE: uv installs no .pyc, and without them every worker and every CLI or
# server process the tests start compiles diffusers' and transformers' imports again (8.0 s
# against 5.3 s an import, measured on a fresh clone).
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest

test: setup
	$(PYTEST) -q -m "not slow" $(PYTEST_PARALLEL)

test-all: setup
	$(PYTEST) -q $(PYTEST_PARALLEL)

clean:
	rm -rf build out
