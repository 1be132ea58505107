"""Launch the MolmoBot policy node.

    ros2 launch molmobot_policy policy.launch.py params_file:=$PWD/my_robot.yaml
    ros2 launch molmobot_policy policy.launch.py params_file:=$PWD/my_robot.yaml \
        namespace:=robot1 checkpoint_path:=/models/MolmoBot-DROID instruction:='put the cup away'
    ros2 launch molmobot_policy policy.launch.py -s        # every argument, described

No parameter file is the default, on purpose: without `params_file` and `checkpoint_path` the
node refuses to configure (`checkpoint_path is empty: ...`) instead of putting random weights
on an arm. The package's `config/policy_tiny.yaml` serves the tiny model's RANDOM weights
(`allow_random_weights: true`), for the simulator and the tests only:

    share=$(ros2 pkg prefix molmobot_policy)/share/molmobot_policy
    ros2 launch molmobot_policy policy.launch.py params_file:=$share/config/policy_tiny.yaml

An argument left empty keeps the parameter file's value (else the node's default); a value
overrides it. The topic arguments set the node's topic parameters: unlike a remap rule, which
must name the topic the file configures, they work whatever the file names. Under a
`namespace` the node, its services and its `~/` topics move (`/robot1/molmobot_policy/...`);
the packaged files' `/**/molmobot_policy:` sections apply in any namespace (a plain
`molmobot_policy:` section applies only without one, and the node refuses such a file);
absolute topic names (`/joint_states`) stay where they are unless set here.
"""
import os

import yaml
from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, LogInfo, OpaqueFunction, SetEnvironmentVariable
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node

PACKAGE = 'molmobot_policy'
NODE_NAME = 'molmobot_policy'
BOOLEAN = ('', 'true', 'false')
LOG_LEVELS = ('debug', 'info', 'warn', 'error', 'fatal')

# name: (default, choices or None, description)
ARGUMENTS = {
    'params_file': ('', None,
                    "the robot's parameter file (start from config/policy_droid.yaml); '': none, "
                    'and then checkpoint_path must be given. config/policy_tiny.yaml of this '
                    "package's share serves RANDOM WEIGHTS (the tiny model: simulator, tests)"),
    'namespace': ('', None,
                  "the node's namespace (robot1: /robot1/molmobot_policy, its services and "
                  "~/ topics); '': none"),
    'checkpoint_path': ('', None,
                        'checkpoint directory (config.yaml + model.pt or *.safetensors, '
                        "tokenizer.json); '': the parameter file's"),
    'instruction': ('', None, "the task text; '': the parameter file's"),
    'use_sim_time': ('', BOOLEAN, "true: follow /clock; '': the parameter file's (default "
                                  'false)'),
    'autostart': ('', BOOLEAN,
                  'true: configure and activate at start; false: wait for lifecycle '
                  "transitions (<namespace>/molmobot_policy/change_state); '': the parameter "
                  "file's (default true)"),
    'log_level': ('info', LOG_LEVELS,
                  "the node's log level (its own logger, <namespace>.molmobot_policy: ROS's "
                  'client libraries keep theirs)'),
    'camera_topics': ('', None,
                      "camera topics in the model's image order, a YAML list: "
                      "'[/front/image_raw, /wrist/image_raw]'; '': the parameter file's"),
    'joint_state_topic': ('', None,
                          "sensor_msgs/JointState topic; '': the parameter file's "
                          '(default /joint_states)'),
    'output_topic': ('', None,
                     "trajectory_msgs/JointTrajectory output topic; '': the parameter file's "
                     '(default ~/joint_trajectory: <namespace>/molmobot_policy/joint_trajectory)'),
}
# arguments that set a node parameter of the same name when not empty, with its type
OVERRIDES = {'checkpoint_path': str, 'instruction': str, 'use_sim_time': bool,
             'autostart': bool, 'camera_topics': list, 'joint_state_topic': str,
             'output_topic': str}


def topic_list(name: str, text: str) -> list:
    """`text` (a launch argument) as a YAML list of topic names.

    Raises:
        ValueError: not a non-empty YAML list of non-empty strings (names the argument).
    """
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as error:
        value = error
    if not (isinstance(value, list) and value
            and all(isinstance(topic, str) and topic for topic in value)):
        raise ValueError(f'{name}:={text!r}: expected a YAML list of topic names, e.g. '
                         "'[/front/image_raw, /wrist/image_raw]'")
    return value


def parameter_overrides(context) -> dict:
    """The node parameters the non-empty override arguments set, as Python values of the
    types the node declares (launch_ros passes a str on as a string: an instruction such as
    'yes' or 'a: b' is not read as YAML)."""
    overrides = {}
    for name, kind in OVERRIDES.items():
        text = LaunchConfiguration(name).perform(context)
        if text == '':
            continue
        if kind is bool:
            overrides[name] = text == 'true'     # the argument's choices: true or false
        elif kind is list:
            overrides[name] = topic_list(name, text)
        else:
            overrides[name] = text
    return overrides


def policy_node(context):
    """The node action of the resolved arguments (and a hint when it cannot start)."""
    params_file = LaunchConfiguration('params_file').perform(context)
    if params_file and not os.path.isfile(os.path.expanduser(params_file)):
        # launch_ros only warns ('Parameter file path is not a file') and starts the node
        # with its defaults: the robot would be configured from none of the user's values
        raise ValueError(f'params_file:={params_file!r}: no such file (a typo? give an '
                         'absolute path, e.g. params_file:=$PWD/my_robot.yaml)')
    overrides = parameter_overrides(context)
    namespace = LaunchConfiguration('namespace').perform(context)
    actions = []
    if not params_file and 'checkpoint_path' not in overrides:
        actions.append(LogInfo(msg=(
            'policy.launch.py: neither params_file nor checkpoint_path given: the node will '
            'refuse to configure. Pass params_file:=/path/to/my_robot.yaml (start from '
            'config/policy_droid.yaml) and checkpoint_path:=/path/to/checkpoint, or, for the '
            "tiny model's random weights (simulation only), params_file:="
            f'{os.path.join(get_package_share_directory(PACKAGE), "config", "policy_tiny.yaml")}')))
    parameters = ([params_file] if params_file else []) + ([overrides] if overrides else [])
    actions.append(Node(
        package=PACKAGE, executable='policy_node', name=NODE_NAME, namespace=namespace,
        output='screen', emulate_tty=True,
        parameters=parameters,
        ros_arguments=['--log-level', f'{node_logger_name(namespace)}:='
                                      f"{LaunchConfiguration('log_level').perform(context)}"]))
    return actions


def node_logger_name(namespace: str) -> str:
    """The node's logger name in `namespace` ('robot1' or '/robot1': robot1.molmobot_policy),
    so that --log-level sets the node's level, not every logger's (a bare level turns on the
    DEBUG lines of rcl, rmw and Fast DDS)."""
    parts = [part for part in namespace.split('/') if part]
    return '.'.join([*parts, NODE_NAME])


def generate_launch_description():
    config = os.path.join(get_package_share_directory(PACKAGE), 'config')
    return LaunchDescription([
        *(DeclareLaunchArgument(name, default_value=default, choices=choices,
                                description=description)
          for name, (default, choices, description) in ARGUMENTS.items()),
        # ~1 MB camera images need a larger shared-memory segment than rmw_fastrtps_cpp's
        # default under ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST (README, 'Large images').
        SetEnvironmentVariable('FASTDDS_DEFAULT_PROFILES_FILE', os.environ.get(
            'FASTDDS_DEFAULT_PROFILES_FILE', os.path.join(config, 'fastdds_large_images.xml'))),
        OpaqueFunction(function=policy_node),
    ])
