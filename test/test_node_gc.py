"""The node keeps the garbage collector off its start-up heap while serving (gc_freeze)
and hands that heap back at cleanup."""
from __future__ import annotations

import gc

import pytest

rclpy = pytest.importorskip('rclpy')
from rclpy.lifecycle import TransitionCallbackReturn  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from molmobot_policy.model.config import MolmoBotConfig  # noqa: E402
from molmobot_policy.ros.node import PolicyNode  # noqa: E402

JOINTS = [f'jaco_joint_{k}' for k in range(1, 7)] + ['jaco_finger_1']


class _Engine:
    """Stands in for PolicyEngine at configure: the tiny preset's contract, no weights."""

    def __init__(self, config):
        self.model_config = MolmoBotConfig.from_name('tiny')
        self.mode = {'model': 'fake'}
        self.closed = False

    def warmup(self, progress=None):
        return 0.0

    def close(self):
        self.closed = True


@pytest.fixture(autouse=True)
def unfrozen_heap():
    """Every test starts and ends with nothing frozen (the freeze is process-wide)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def _node(context, name, gc_freeze):
    return PolicyNode(engine_factory=_Engine, node_name=name, context=context,
                      parameter_overrides=[
                          Parameter('autostart', value=False),
                          Parameter('camera_topics', value=['/gc_cam0', '/gc_cam1']),
                          Parameter('joint_names', value=JOINTS),
                          Parameter('action_joint_names', value=JOINTS),
                          Parameter('model', value='tiny'),
                          Parameter('allow_random_weights', value=True),
                          Parameter('gc_freeze', value=gc_freeze)])


def test_configure_freezes_the_start_up_heap_and_cleanup_releases_it(ros_context):
    node = _node(ros_context, 'gc_freeze_on', True)
    try:
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS
        assert gc.get_freeze_count() > 0
        engine = node.engine
        assert node.trigger_cleanup() == TransitionCallbackReturn.SUCCESS
        assert engine.closed
        assert gc.get_freeze_count() == 0
    finally:
        node.destroy_node()


def test_gc_freeze_false_leaves_the_collector_alone(ros_context):
    node = _node(ros_context, 'gc_freeze_off', False)
    try:
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS
        assert gc.get_freeze_count() == 0
    finally:
        node.destroy_node()


def test_cleanup_leaves_a_freeze_it_did_not_make(ros_context):
    node = _node(ros_context, 'gc_freeze_foreign', False)
    try:
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS
        gc.freeze()                                  # e.g. the embedding application's
        frozen = gc.get_freeze_count()
        assert node.trigger_cleanup() == TransitionCallbackReturn.SUCCESS
        # still frozen (refcounting may have freed a few of the frozen objects)
        assert gc.get_freeze_count() > frozen // 2 > 0
    finally:
        node.destroy_node()
