"""The robot contract as node parameters: camera topics -> images, joint names -> state,
action joints -> action dims, gripper threshold, normalization stats key, tokenizer; refused
at configure with an error naming the parameter, before any weights are loaded. And the
example parameter file for MolmoBot-DROID (config/policy_droid.yaml). The node runs in this
process (its own rclpy context) and is configured through `trigger_configure`."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip('rclpy')

import rclpy  # noqa: E402
from rclpy.context import Context  # noqa: E402
from rclpy.lifecycle import TransitionCallbackReturn  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from molmobot_policy.model.config import MolmoBotConfig  # noqa: E402
from molmobot_policy.ros.node import PolicyNode, check_robot_contract  # noqa: E402
from molmobot_policy.ros.parameters import PARAMETERS  # noqa: E402
from molmobot_policy.runtime.engine import EngineConfig, PolicyEngine  # noqa: E402

from _golden import GOLDEN, MISSING  # noqa: E402  (test/_golden.py: the data's location)

REPO = Path(__file__).resolve().parents[1]
DROID_YAML = REPO / 'config' / 'policy_droid.yaml'
JOINTS = [f'joint_{k}' for k in range(7)] + ['gripper']
ROBOT = {'camera_topics': ['/exo/image_raw', '/wrist/image_raw'], 'joint_names': JOINTS,
         'action_joint_names': JOINTS, 'instruction': 'pick up the red cube'}

# not the node's default name: other tests in this process talk to /molmobot_policy/...
NODE_NAME = 'robot_contract_test_policy'

needs_golden = pytest.mark.skipif(not (GOLDEN / 'model.pt').is_file(),
                                  reason=MISSING)


@pytest.fixture(scope='module')
def context():
    context = Context()
    rclpy.init(context=context)
    yield context
    rclpy.try_shutdown(context=context)


class RecordingLogger:
    """The node's logger, with the error lines kept for the test."""

    def __init__(self, logger) -> None:
        self._logger, self.errors = logger, []

    def error(self, message, **kwargs):
        self.errors.append(message)
        return self._logger.error(message, **kwargs)

    def __getattr__(self, name):
        return getattr(self._logger, name)


class ConfiguredNode:
    """A PolicyNode with the given parameters whose engine factory records each call."""

    def __init__(self, context, parameters: dict, build_engine: bool = True) -> None:
        self.engine_configs = []

        def factory(config: dict):
            self.engine_configs.append(config)
            if not build_engine:
                raise AssertionError('the engine must not be built')
            options = dict(config)
            contract = options.pop('contract')
            return PolicyEngine(EngineConfig(**options), contract=contract)

        self.node = PolicyNode(engine_factory=factory, node_name=NODE_NAME, context=context,
                               parameter_overrides=[Parameter(name, value=value)
                                                    for name, value in parameters.items()])
        self.logger = RecordingLogger(self.node.get_logger())
        self.node.get_logger = lambda: self.logger

    def configure(self) -> TransitionCallbackReturn:
        return self.node.trigger_configure()

    def close(self) -> None:
        self.node.destroy_node()        # releases the engine too


@pytest.fixture
def make_node(context):
    nodes = []

    def make(parameters: dict, build_engine: bool = True) -> ConfiguredNode:
        nodes.append(ConfiguredNode(context, {'autostart': False, 'allow_random_weights': True,
                                              **parameters}, build_engine))
        return nodes[-1]

    yield make
    for node in nodes:
        node.close()


def droid_parameters() -> dict:
    return yaml.safe_load(DROID_YAML.read_text())['/**/molmobot_policy']['ros__parameters']


# ------------------------------------------------------------------ the contract check
TINY = MolmoBotConfig.from_name('tiny')     # max_images 8, state_dim 8, action_dim 8


@pytest.mark.parametrize('change, parameter', [
    ({'camera_topics': [f'/cam{k}' for k in range(9)]}, r"9 cameras \['/cam0'"),
    ({'camera_topics': ['/cam0']}, r"1 camera \['/cam0'\]"),
    ({'joint_names': [f'j{k}' for k in range(9)]}, 'joint_names has 9 joints'),
    ({'action_joint_names': [f'j{k}' for k in range(9)]}, 'action_joint_names has 9 joints'),
    ({'gripper_index': 8}, 'gripper_index=8'),
    ({'gripper_index': -2}, 'gripper_index=-2'),
])
def test_contract_violations_are_refused_naming_the_parameter(change, parameter):
    robot = {'camera_topics': ROBOT['camera_topics'], 'joint_names': JOINTS,
             'action_joint_names': JOINTS, 'gripper_index': -1, **change}
    with pytest.raises(ValueError, match=parameter):
        check_robot_contract(TINY, **robot)


def test_fewer_joints_than_the_state_width_are_accepted():
    check_robot_contract(TINY, ROBOT['camera_topics'], JOINTS[:3], JOINTS[:3], gripper_index=-1)


# ------------------------------------------------------------------ the node at configure
def test_more_cameras_than_max_images_is_refused_before_the_model_is_built(make_node):
    node = make_node({**ROBOT, 'model': 'molmobot-droid',
                      'camera_topics': ['/a', '/b', '/c']}, build_engine=False)
    assert node.configure() == TransitionCallbackReturn.FAILURE
    assert node.engine_configs == []       # refused from the config alone
    assert any("3 cameras ['/a', '/b', '/c']" in e and 'max_images=2' in e
               for e in node.logger.errors), node.logger.errors


@needs_golden
def test_unknown_norm_stats_key_is_refused_before_the_weights_load(make_node):
    node = make_node({**ROBOT, 'checkpoint_path': str(GOLDEN), 'norm_stats_key': 'droid'},
                     build_engine=False)
    assert node.configure() == TransitionCallbackReturn.FAILURE
    assert node.engine_configs == []
    assert any("'droid'" in e and 'synthmanip' in e for e in node.logger.errors), \
        node.logger.errors


@needs_golden
def test_contract_parameters_reach_the_engine(make_node):
    node = make_node({**ROBOT, 'checkpoint_path': str(GOLDEN), 'norm_stats_key': 'synthmanip',
                      'tokenizer': 'tiny', 'gripper_index': 7, 'gripper_threshold': 128.0,
                      'gripper_open': -1.0, 'gripper_closed': 2.0})
    assert node.configure() == TransitionCallbackReturn.SUCCESS, node.logger.errors
    config, contract = node.node.engine.config, node.node.engine.contract
    assert (config.norm_stats_key, config.tokenizer) == ('synthmanip', 'tiny')
    assert (contract.gripper_index, contract.gripper_threshold) == (7, 128.0)
    assert (contract.gripper_open, contract.gripper_closed) == (-1.0, 2.0)
    assert contract.camera_names == tuple(ROBOT['camera_topics'])   # one image per topic
    assert contract.joint_names == contract.action_joint_names == tuple(JOINTS)


# ------------------------------------------------------------------ config/policy_droid.yaml
def test_droid_file_sets_only_declared_parameters_with_their_types():
    parameters = droid_parameters()
    unknown = sorted(set(parameters) - set(PARAMETERS))
    assert not unknown
    for name, value in parameters.items():
        default = PARAMETERS[name][0]
        if isinstance(default, list) and not default:
            assert isinstance(value, list), name
        else:
            assert type(value) is type(default), (name, value, default)


def test_droid_file_executes_8_of_16_actions_then_requeries():
    parameters = droid_parameters()
    assert parameters['chunk_period'] == pytest.approx(8 * parameters['control_period'],
                                                       rel=1e-6)
    assert len(parameters['camera_topics']) == 2
    assert len(parameters['joint_names']) == len(parameters['action_joint_names']) == 8


def test_droid_file_targets_a_compiled_bfloat16_cuda_engine():
    parameters = droid_parameters()
    assert (parameters['device'], parameters['dtype']) == ('cuda', 'bfloat16')
    assert parameters['compile'] and parameters['cuda_graphs'] and parameters['buckets']


@needs_golden
def test_droid_file_configures_with_a_checkpoint_of_its_shape_on_the_cpu(make_node):
    # the golden checkpoint ships no tokenizer.json: its built-in tiny tokenizer, explicitly
    cpu = {'checkpoint_path': str(GOLDEN), 'tokenizer': 'tiny', 'device': 'cpu',
           'dtype': 'float32', 'compile': False, 'cuda_graphs': False,
           'gripper_threshold': 128.0}
    node = make_node({**droid_parameters(), **cpu, 'autostart': False})
    assert node.configure() == TransitionCallbackReturn.SUCCESS, node.logger.errors
    engine = node.node.engine
    assert len(engine.contract.camera_names) == 2 and engine.config.buckets == (448, 512)
    assert engine.contract.gripper_index == 7
