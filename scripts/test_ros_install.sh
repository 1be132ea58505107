#!/usr/bin/env bash
# make test, second part: both packages (molmobot_policy at the root, molmobot_policy_demo in
# demo/) installed as a ROS 2 workspace installs them, and the tests that need that install
# (test/installed/), in a pytest call of their own.
#
#   bash scripts/test_ros_install.sh [VENV]        (VENV: .venv; make test runs it)
#   OVERLAY_ONLY=1 bash scripts/test_ros_install.sh [VENV]   (make launch-overlay: step 2
#                                                   alone, for `ros2 launch` on a robot)
#
# 1. colcon build of this source tree into a temporary prefix (removed afterwards), both
#    folders named as base paths: colcon's crawl stops at the root's package.xml, so a plain
#    `colcon build` finds the policy package alone (a robot's build) and never sees demo/ or
#    .venv (docs/decisions/one-ros-package.md). A plain install, not --symlink-install: the
#    launch and config files `ros2 launch` reads are then the copies setup.py's data_files
#    install, so a file missing there fails the tests; and merged, one prefix for both.
# 2. The ROS 2 launch stack: the environment's where it imports (a full ROS 2 install), else
#    the wheels of ../shared/wheels (LAUNCH_WHEELS) in an overlay prefix, VENV/launch-overlay
#    (installed again when their SHA256SUMS change), else none: the launch tests skip, saying
#    why. The overlay reaches only this pytest call (PYTHONPATH), so launch_testing's pytest
#    plugins never load in the unit tests' call.
# 3. python -m pytest test/installed with the install (and overlay) on AMENT_PREFIX_PATH,
#    PYTHONPATH and PATH: the install layout and its entry points, launch_testing tests of
#    the launch files, `ros2 launch` runs.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(cd "${1:-.venv}" && pwd)
PY=$VENV/bin/python
WHEELS=${LAUNCH_WHEELS:-../shared/wheels}

work=$(mktemp -d "${TMPDIR:-/tmp}/molmobot_policy_install.XXXXXX")
trap 'rm -rf "$work"' EXIT

if [ "${OVERLAY_ONLY:-0}" != 1 ]; then
  echo "== colcon build: $(pwd) and $(pwd)/demo into the temporary prefix $work/install"
  if ! "$VENV/bin/colcon" --log-base "$work/log" build --base-paths . demo \
      --build-base "$work/build" --install-base "$work/install" --merge-install \
      --event-handlers console_direct-; then
    cat "$work"/log/latest_build/molmobot_policy*/stdout_stderr.log >&2 || true
    exit 1
  fi
fi

launch_stack() { "$PY" -c 'import launch_testing_ros, launch_ros, ros2launch' 2>/dev/null; }
if launch_stack; then
  echo "== launch stack: the environment's ($("$PY" -c 'import launch; print(launch.__file__)'))"
elif [ ! -f "$WHEELS/install.sh" ]; then
  echo "== launch stack: none (no ROS 2 install, no $WHEELS): the launch tests skip"
elif ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "== launch stack: none ($WHEELS holds CPython 3.11 wheels): the launch tests skip"
else
  overlay=$VENV/launch-overlay
  if ! cmp -s "$WHEELS/SHA256SUMS" "$overlay/SHA256SUMS"; then
    echo "== launch stack: installing $WHEELS into the overlay $overlay"
    rm -rf "$overlay"
    "$PY" -m pip install --quiet --no-deps --ignore-installed --prefix "$overlay" \
      "$(grep '^osrf-pycommon==' "$WHEELS/requirements-launch.txt")"
    bash "$WHEELS/install.sh" "$PY" "$overlay" > /dev/null
    cp "$WHEELS/SHA256SUMS" "$overlay/SHA256SUMS"
  fi
  echo "== launch stack: $WHEELS in the overlay $overlay"
  export PYTHONPATH=$overlay/lib/python3.11/site-packages${PYTHONPATH:+:$PYTHONPATH}
  export AMENT_PREFIX_PATH=$overlay:$VENV${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}
  export LD_LIBRARY_PATH=$overlay/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PATH=$overlay/bin:$PATH
  launch_stack || { echo "the launch stack in $overlay does not import" >&2; exit 1; }
fi
if [ "${OVERLAY_ONLY:-0}" = 1 ]; then
  launch_stack && exit 0
  echo "no launch stack to use (see the line above)" >&2; exit 1
fi

set +u      # colcon's setup scripts read unset variables
# shellcheck disable=SC1091
. "$work/install/local_setup.sh"
set -u
export MOLMOBOT_INSTALL_PREFIX=$work/install
echo "== tests of the installed package (test/installed)"
"$PY" -m pytest -v -rs test/installed "${@:2}"
