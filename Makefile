# molmobot_policy: set-up, demo and tests. Every target works on a fresh clone.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
DURATION ?= 30
# DDS stays on this machine; the demo uses its own domain (tests pick a random one).
export ROS_AUTOMATIC_DISCOVERY_RANGE := LOCALHOST
export RMW_IMPLEMENTATION := rmw_fastrtps_cpp
# ~1 MB camera images need a bigger Fast DDS shared-memory segment than rmw_fastrtps_cpp's
# 512 KiB (README "Large images over DDS"); FASTDDS_BUILTIN_TRANSPORTS is ignored on LOCALHOST.
export FASTDDS_DEFAULT_PROFILES_FILE ?= $(CURDIR)/config/fastdds_large_images.xml
export MUJOCO_GL ?= egl
export PYOPENGL_PLATFORM ?= egl

.PHONY: setup demo test launch-overlay clean

setup: $(VENV)/.installed

# Both packages of the repository, editable: the policy node (.) and the demo (demo/).
$(VENV)/.installed: requirements.txt requirements/runtime.txt requirements/demo.txt requirements/test.txt setup.py demo/setup.py scripts/install_system_deps.sh
	bash scripts/install_system_deps.sh
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e . -e demo
	touch $@

demo: setup
	ROS_DOMAIN_ID=$${ROS_DOMAIN_ID:-42} $(PY) -m molmobot_policy_demo.demo --duration $(DURATION)

# Two pytest calls: the unit and node tests, then (scripts/test_ros_install.sh) a colcon install
# of both packages (. and demo/) with the tests that need it, where launch_testing's pytest
# plugins load.
test: setup
	$(PY) -m pytest -q -rs test --ignore=test/installed
	bash scripts/test_ros_install.sh $(VENV)

# The ROS 2 launch stack of ../shared/wheels in $(VENV)/launch-overlay, alone (make test installs
# it too), for `ros2 launch` without a ROS 2 install (docs/ROBOT.md).
launch-overlay: setup
	OVERLAY_ONLY=1 bash scripts/test_ros_install.sh $(VENV)

clean:
	rm -rf $(VENV) build *.egg-info demo/build demo/*.egg-info
