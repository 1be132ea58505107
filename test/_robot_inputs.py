"""Camera frames and joint states for tests that feed a policy node (no test here)."""


def publish_robot_inputs(node, camera_topics, joint_state_topic: str, joint_names,
                         period: float = 0.1, height: int = 32, width: int = 40):
    """A timer on `node` publishing black rgb8 frames on every camera topic (sensor-data QoS)
    and zero joint positions, all stamped now, every `period` s. Returns the timer."""
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import Image, JointState
    cameras = [node.create_publisher(Image, t, qos_profile_sensor_data) for t in camera_topics]
    joints = node.create_publisher(JointState, joint_state_topic, 10)
    pixels = bytes(height * width * 3)

    def publish():
        stamp = node.get_clock().now().to_msg()
        for camera in cameras:
            msg = Image(height=height, width=width, encoding='rgb8', step=3 * width,
                        data=pixels)
            msg.header.stamp = stamp
            camera.publish(msg)
        state = JointState(name=list(joint_names), position=[0.0] * len(joint_names))
        state.header.stamp = stamp
        joints.publish(state)

    return node.create_timer(period, publish)
