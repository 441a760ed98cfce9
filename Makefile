# The two commands of the README, each doing all set-up itself on a fresh machine:
#   make demo   - the main job: the simulated robot (sim_node) driven by the shipped demo policy (oxygen_node), live
#   make test   - the test suite (what .ci/run runs)
# Other targets: make setup (environment + package only), make bench (engine benchmark), make ros-bench,
# make golden (regenerate the bag-eval golden output, test/bag_golden.py), make train-demo (reproduce the shipped
# demo policy: record expert episodes, train, copy into checkpoints/demo), make eval-demo (its evaluation), make clean.
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

.PHONY: setup test demo bench ros-bench golden train-demo eval-demo clean
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

# The shipped demo policy, reproduced (checkpoints/demo/README.md has the measured times): 900 expert episodes
# (seeds 100000-100299 per task; the second half with detour noise) -> train -> checkpoints/demo.
DATA ?= data
RUN ?= runs/demo
TRAIN_ARGS ?= --preset demo --steps 5000 --batch-size 32 --lr 4e-4 --warmup 300 --text-weight 1.0 --bf16 --compile \
	--threads 2 --val-fraction 0.03 --ckpt-every 1000 --val-every 500 --log-every 50
train-demo: setup
	$(VENV)/bin/oxygen sim-record --out $(DATA)/train_a --seeds 100000:100150 --overwrite --quiet
	$(VENV)/bin/oxygen sim-record --out $(DATA)/train_b --seeds 100150:100300 --noise 0.03 --overwrite --quiet
	$(VENV)/bin/oxygen train $(DATA)/train_a $(DATA)/train_b --out $(RUN) $(TRAIN_ARGS)
	$(PY) -m oxygen_ros.train.export $(RUN) checkpoints/demo

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
