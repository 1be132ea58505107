#!/usr/bin/env bash
# Downloads the ROS 2 Kilted cp312 wheels the GPU machine needs into .whl/ (git-ignored,
# about 43 MB): every ros-* package installed in .venv at its pinned version, minus the
# build-time linters and code generators, plus the runtime pieces of rosidl and lark.
# Run here (it needs PyPI), then name `.whl` in the device call's `carry`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
.venv/bin/python -m pip freeze | grep -E '^ros-' \
  | grep -vE 'cppcheck|cpplint|flake8|pep257|uncrustify|rosidl-generator-(c|cpp|type-description)==|rosidl-adapter|rosidl-cli|rosidl-cmake|rmw-implementation-cmake' \
  > /tmp/molmobot_ros_pins.txt
echo 'lark-parser==0.12.0' >> /tmp/molmobot_ros_pins.txt
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform any -d .whl -r /tmp/molmobot_ros_pins.txt
ls .whl | wc -l
