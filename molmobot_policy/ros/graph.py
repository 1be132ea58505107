"""What the ROS graph says about the node's inputs and output (rclpy's graph queries, no
message traffic): another node of the same name, another publisher on the output topic, topic
names that resolve to one topic, and why a subscribed topic may receive nothing. Each takes
the node; none raises on a failed graph query where it only gives a hint."""
from __future__ import annotations

import time

from rclpy.qos import ReliabilityPolicy

from molmobot_policy.preprocess.transforms import repeated

IMAGE_TYPE = 'sensor_msgs/msg/Image'
COMPRESSED_TYPE = 'sensor_msgs/msg/CompressedImage'
JOINT_STATE_TYPE = 'sensor_msgs/msg/JointState'


def same_name_problem(node) -> str:
    """'' or why `node` must not configure: another node of its fully qualified name is in the
    graph (both would command the arm, answer the same lifecycle services, so that a
    deactivate stops one of them, and publish the same status names)."""
    me = (node.get_name(), node.get_namespace())
    twins = sum(1 for name_ns in node.get_node_names_and_namespaces() if name_ns == me)
    if twins <= 1:
        return ''
    return (f'another node named {node.get_fully_qualified_name()} is running ({twins} in the '
            'ROS graph): stop it, or start this one under another name or namespace (its '
            'lifecycle services, topics and status names would be shared)')


DISCOVERY_SETTLE_S = 2.0    # how long after its start a node may miss a running twin


def wait_for_same_name(node, since: float, poll_s: float = 0.05) -> str:
    """`same_name_problem`, asked until it finds a twin or until DISCOVERY_SETTLE_S s have
    passed since `since` (time.monotonic() when `node` was created): a node that just started
    has not yet discovered the others (DDS discovery takes a few hundred ms on one machine),
    so an early question would miss a running twin."""
    while True:
        problem = same_name_problem(node)
        if problem or time.monotonic() - since >= DISCOVERY_SETTLE_S:
            return problem
        time.sleep(poll_s)


def other_commanders(node, topic: str) -> str:
    """'' or why no chunk may be sent on `topic` (resolved): another publisher on it (a second
    policy node, a teleop); the controller would switch between the two every chunk, each
    limited against its own last chunk, not the other's (a jump)."""
    try:
        publishers = node.get_publishers_info_by_topic(topic)
    except Exception:  # noqa: BLE001 - the graph is a check, not a reason to fail
        return ''
    if len(publishers) <= 1:
        return ''
    names = sorted(f"{p.node_namespace.rstrip('/')}/{p.node_name}" for p in publishers)
    me = node.get_fully_qualified_name()
    twin = (f'; another node named {me} (this node\'s name) is one of them: stop one'
            if names.count(me) > 1 else '')
    return (f"{len(publishers)} publishers on {topic} ({', '.join(names)}): two commanders "
            'would alternate chunks on the arm; nothing is sent until this node is the only '
            f'one{twin}')


def shared_topics_problem(node, cameras: list[str], joint_state_topic: str) -> str:
    """'' or which of `cameras` and `joint_state_topic` (as written in the parameters) resolve
    to one topic in `node` (a relative and an absolute name in the root namespace, a remap
    rule): the parameter check sees only the names as written."""
    written = [*cameras, joint_state_topic]
    resolved = [node.resolve_topic_name(t) for t in written]
    twice = repeated(resolved)
    if not twice:
        return ''
    groups = '; '.join(f'{[w for w, r in zip(written, resolved) if r == topic]} all resolve '
                       f'to {topic}' for topic in twice)
    return (f'camera_topics / joint_state_topic: {groups} (namespace, relative names, remap '
            'rules); each input needs its own topic')


def silence_hint(node, expected_type: str, reliable: bool, topic: str) -> str:
    """Why nothing may arrive on the subscribed `topic` (resolved), from the graph: ': nothing
    publishes it', its publishers' message type when it is not `expected_type`, or only best
    effort publishers for a `reliable` subscription; '' when none of these."""
    try:
        publishers = node.get_publishers_info_by_topic(topic)
    except Exception:  # noqa: BLE001 - a hint only, never a reason to fail the tick
        return ''
    if not publishers:
        return ': nothing publishes it (ROS graph)'
    types = sorted({p.topic_type for p in publishers})
    if expected_type not in types:
        return (f": its publishers send {', '.join(types)}, this node expects {expected_type}"
                + (' (camera_transports?)' if expected_type != JOINT_STATE_TYPE else ''))
    if reliable and all(p.qos_profile.reliability == ReliabilityPolicy.BEST_EFFORT
                        for p in publishers):
        return ': its publishers are best effort and camera_qos is reliable (incompatible)'
    return ''
