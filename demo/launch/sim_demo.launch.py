"""Launch the simulated Jaco robot and the policy node together (the demo as launch files).

    ros2 launch molmobot_policy_demo sim_demo.launch.py
    ros2 launch molmobot_policy_demo sim_demo.launch.py namespace:=sim1 autostart:=false
    ros2 launch molmobot_policy_demo sim_demo.launch.py -s        # every argument, described

The simulator is this package's (molmobot_policy_demo) sim_robot with its config/sim.yaml; the
policy node comes from molmobot_policy's policy.launch.py with
`params_file:=<policy_params_file>` (default: molmobot_policy's config/policy_tiny.yaml, the
tiny model's RANDOM weights: a simulator is where they belong);
every other argument of policy.launch.py (instruction, autostart, log_level, checkpoint_path,
the topics, ...) is taken from the command line as it is. Both nodes run in `namespace`: the
simulator follows the policy's output there (config/sim.yaml's relative `trajectory_topic`);
the cameras and /joint_states keep the absolute names both packaged files give them. The
simulator publishes no /clock: both nodes run on the system clock.
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, IncludeLaunchDescription, SetEnvironmentVariable
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node

POLICY_PACKAGE = 'molmobot_policy'
DEMO_PACKAGE = 'molmobot_policy_demo'


def generate_launch_description():
    share = get_package_share_directory(POLICY_PACKAGE)
    config = os.path.join(share, 'config')
    demo_config = os.path.join(get_package_share_directory(DEMO_PACKAGE), 'config')
    return LaunchDescription([
        DeclareLaunchArgument(
            'policy_params_file', default_value=os.path.join(config, 'policy_tiny.yaml'),
            description="policy node parameter file; the default serves the tiny model's "
                        'RANDOM WEIGHTS (simulation only)'),
        DeclareLaunchArgument('sim_params_file',
                              default_value=os.path.join(demo_config, 'sim.yaml'),
                              description='simulated robot parameter file'),
        DeclareLaunchArgument('namespace', default_value='',
                              description="namespace of both nodes (sim1: /sim1/sim_robot, "
                                          "/sim1/molmobot_policy); '': none"),
        # ~1 MB camera images need a larger shared-memory segment than rmw_fastrtps_cpp's
        # default under ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST (README, 'Large images').
        SetEnvironmentVariable('FASTDDS_DEFAULT_PROFILES_FILE', os.environ.get(
            'FASTDDS_DEFAULT_PROFILES_FILE', os.path.join(config, 'fastdds_large_images.xml'))),
        SetEnvironmentVariable('MUJOCO_GL', os.environ.get('MUJOCO_GL', 'egl')),
        # the policy first: a bad argument fails there, before the simulator starts
        IncludeLaunchDescription(
            PythonLaunchDescriptionSource(os.path.join(share, 'launch', 'policy.launch.py')),
            launch_arguments={'params_file': LaunchConfiguration('policy_params_file'),
                              'namespace': LaunchConfiguration('namespace')}.items()),
        Node(package=DEMO_PACKAGE, executable='sim_robot', name='sim_robot',
             namespace=LaunchConfiguration('namespace'), output='screen', emulate_tty=True,
             parameters=[LaunchConfiguration('sim_params_file')]),
    ])
