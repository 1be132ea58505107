"""Launch the MolmoBot policy node with a parameter file (full ROS 2 install).

    ros2 launch molmobot_policy policy.launch.py params_file:=/path/to/policy.yaml
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, SetEnvironmentVariable
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node


def generate_launch_description():
    config = os.path.join(get_package_share_directory('molmobot_policy'), 'config')
    return LaunchDescription([
        DeclareLaunchArgument('params_file', default_value=os.path.join(config, 'policy_tiny.yaml'),
                              description='policy node parameter file'),
        # ~1 MB camera images need a larger shared-memory segment than rmw_fastrtps_cpp's
        # default under ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST (README, 'Large images').
        SetEnvironmentVariable('FASTDDS_DEFAULT_PROFILES_FILE', os.environ.get(
            'FASTDDS_DEFAULT_PROFILES_FILE', os.path.join(config, 'fastdds_large_images.xml'))),
        DeclareLaunchArgument('use_sim_time', default_value='false',
                              description='follow /clock'),
        Node(package='molmobot_policy', executable='policy_node', name='molmobot_policy',
             output='screen', emulate_tty=True,
             parameters=[LaunchConfiguration('params_file'),
                         {'use_sim_time': LaunchConfiguration('use_sim_time')}]),
    ])
