"""Test-wide settings. DDS traffic stays on this machine, and every pytest run picks its own
random ROS domain so that parallel runs (and the demo) never cross-talk (DESIGN.md,
"Environment facts"). Set here, at import time, before any test module imports rclpy;
subprocesses started by tests inherit the environment."""
import os
import random

os.environ['ROS_AUTOMATIC_DISCOVERY_RANGE'] = 'LOCALHOST'
os.environ.setdefault('RMW_IMPLEMENTATION', 'rmw_fastrtps_cpp')
if 'MOLMOBOT_TEST_DOMAIN_ID' in os.environ:
    os.environ['ROS_DOMAIN_ID'] = os.environ['MOLMOBOT_TEST_DOMAIN_ID']
else:
    os.environ['ROS_DOMAIN_ID'] = str(random.SystemRandom().randint(150, 230))
