"""What the tests of test/installed/ share: the packages' install prefix, found the way
launch_ros and `ros2 launch` find it (the ament index on AMENT_PREFIX_PATH), and the skips,
with their reasons, where there is no install or no launch stack.

`make test` provides both (scripts/test_ros_install.sh): a colcon install of this source tree's
two packages (molmobot_policy, molmobot_policy_demo from demo/) in one temporary prefix (its
path in MOLMOBOT_INSTALL_PREFIX) and the launch stack, the environment's or the wheels of
../shared/wheels in an overlay."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

PACKAGE = 'molmobot_policy'
DEMO_PACKAGE = 'molmobot_policy_demo'
NO_INSTALL = ('{package} is in no ament prefix of AMENT_PREFIX_PATH: `make test` installs it '
              'with colcon (scripts/test_ros_install.sh); by hand: colcon build --base-paths '
              '. demo, then . install/local_setup.sh')
NO_LAUNCH = ('the ROS 2 launch stack (launch, launch_ros, launch_testing) is not importable '
             '({error}): a full ROS 2 install has it; `make test` installs it from '
             '../shared/wheels where that folder is beside the clone')


def installed_prefix(package: str = PACKAGE) -> Path:
    """The install prefix holding `package` (`<prefix>/share/<package>`,
    `<prefix>/lib/<package>/<executable>`). Skips the calling module where there is none;
    fails where MOLMOBOT_INSTALL_PREFIX names another (the install under test is not the one
    found)."""
    try:
        from ament_index_python.packages import PackageNotFoundError, get_package_prefix
    except ImportError as error:
        pytest.skip(f'ament_index_python is not importable ({error})', allow_module_level=True)
    try:
        prefix = Path(get_package_prefix(package))
    except (PackageNotFoundError, OSError):     # OSError: AMENT_PREFIX_PATH unset
        expected = os.environ.get('MOLMOBOT_INSTALL_PREFIX')
        if expected:
            pytest.fail(f'MOLMOBOT_INSTALL_PREFIX={expected} but {package} is in no prefix of '
                        f"AMENT_PREFIX_PATH={os.environ.get('AMENT_PREFIX_PATH', '')!r}",
                        pytrace=False)
        pytest.skip(NO_INSTALL.format(package=package), allow_module_level=True)
    expected = os.environ.get('MOLMOBOT_INSTALL_PREFIX')
    if expected and prefix != Path(expected):
        pytest.fail(f'the ament index finds {package} in {prefix}, not in the install under '
                    f'test MOLMOBOT_INSTALL_PREFIX={expected}', pytrace=False)
    return prefix
