"""Camera frames and joint states for tests that feed a policy node (no test here)."""


def publish_robot_inputs(node, camera_topics, joint_state_topic: str, joint_names,
                         period: float = 0.1, height: int = 32, width: int = 40,
                         compressed: bool = False):
    """A timer on `node` publishing black rgb8 frames on every camera topic (sensor-data QoS;
    `compressed`: jpeg sensor_msgs/CompressedImage on <topic>/compressed) and zero joint
    positions, all stamped now, every `period` s. Returns the timer."""
    import numpy as np
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import CompressedImage, Image, JointState

    from molmobot_policy.ros import codec
    if compressed:
        cameras = [node.create_publisher(CompressedImage, f'{t}/compressed',
                                         qos_profile_sensor_data) for t in camera_topics]
        jpeg = codec.rgb_to_jpeg(np.zeros((height, width, 3), np.uint8))
    else:
        cameras = [node.create_publisher(Image, t, qos_profile_sensor_data)
                   for t in camera_topics]
    joints = node.create_publisher(JointState, joint_state_topic, 10)
    pixels = bytes(height * width * 3)

    def publish():
        stamp = node.get_clock().now().to_msg()
        for camera in cameras:
            if compressed:
                msg = CompressedImage(format=codec.JPEG_FORMAT, data=jpeg)
            else:
                msg = Image(height=height, width=width, encoding='rgb8', step=3 * width,
                            data=pixels)
            msg.header.stamp = stamp
            camera.publish(msg)
        state = JointState(name=list(joint_names), position=[0.0] * len(joint_names))
        state.header.stamp = stamp
        joints.publish(state)

    return node.create_timer(period, publish)


class StandInEngine:
    """An engine for node tests without a model: the tiny preset's config and contract,
    instant warm-up, and a chunk of 16 x 8 actions all equal to `action_value(observation)`
    (default 0.0); `inference_seconds` as the real engine's warm-up measures it (None: not)."""

    inference_seconds = None

    def __init__(self, config):
        from molmobot_policy.model.config import MolmoBotConfig
        self.config = config
        self.model_config = MolmoBotConfig.from_name('tiny')
        self.mode = {'model': 'stand-in'}

    def warmup(self, progress=None):
        return 0.0

    def check_instruction(self, instruction):
        return 1

    def close(self):
        pass

    def action_value(self, observation) -> float:
        return 0.0

    def predict(self, observation):
        import numpy as np
        from molmobot_policy.types import ActionChunk
        actions = np.full((16, 8), self.action_value(observation), np.float32)
        return ActionChunk(actions=actions, actions_normalized=actions,
                           observation_stamp=observation.stamp,
                           observation_seq=observation.seq, inference_ms=1.0)


class InProcessGraph:
    """The part shared by the in-process node tests' graphs: a PolicyNode (`policy`) and a
    peer node (`peer`) on their own `context`, in one `executor` spun by `thread` (None
    until started); the peer's callbacks append under `lock`. Subclasses build them."""

    _stop_spinning = False      # set by `close`: `spin` returns

    def wait_for(self, predicate, timeout: float = 20.0) -> bool:
        """Poll `predicate()` (under `lock`) every 20 ms until true (True) or `timeout` s."""
        import time
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if predicate():
                    return True
            time.sleep(0.02)
        return False

    def in_executor(self, fn, timeout: float = 30.0):
        """fn() run on the executor's thread (as a lifecycle service call runs in the node):
        a transition called from the test thread destroys subscriptions the spinning thread
        may be waiting on. Returns fn's result."""
        import time
        task = self.executor.create_task(fn)
        self.executor.wake()
        deadline = time.monotonic() + timeout
        while not task.done():
            assert time.monotonic() < deadline, f'{fn} did not finish in {timeout} s'
            assert self.thread is None or self.thread.is_alive(), 'the executor thread died'
            time.sleep(0.01)
        return task.result()

    def spin(self) -> None:
        """The executor thread's target: spins until `close` asks it to stop or the context
        goes down. `close` stops it before it shuts the executor down: a callback still
        running in `Executor.spin` would otherwise touch the destroyed guard condition
        (InvalidHandle, a warning in another test)."""
        from rclpy.executors import ExternalShutdownException
        try:
            while not self._stop_spinning and self.context.ok():
                self.executor.spin_once(timeout_sec=0.05)
        except ExternalShutdownException:       # a test took the context down
            pass

    def close(self) -> None:
        import rclpy
        self._stop_spinning = True
        if self.thread is not None:
            self.thread.join(timeout=5.0)
        self.executor.shutdown(timeout_sec=2.0)
        self.policy.destroy_node()
        self.peer.destroy_node()
        rclpy.try_shutdown(context=self.context)


def graphs(graph_class):
    """Generator body of a `graph` fixture: yields make(name, **kwargs) -> a new
    graph_class(name, **kwargs); closes every graph made afterwards."""
    made = []

    def make(name, **kwargs):
        made.append(graph_class(name, **kwargs))
        return made[-1]
    yield make
    for graph in made:
        graph.close()


class RecordingGraph(InProcessGraph):
    """A PolicyNode (engine `engine`, `cameras`, `joint_state_topic` with `joints`; a 0.2 s
    chunk period, 0.05 s control period, diagnostics period 0.2 s and the cameras received
    in process (the rules under test are the synchronizer's, which the receiver process feeds
    too: test_node_camera_receiver) unless `parameters` say otherwise) and a peer
    publishing 4x4 frames and the joint state every 0.05 s, spun in one executor thread on
    their own context; the node is autostarted (`cli_args`: its
    command line, e.g. remap rules). The peer records ~/chunk_info as dicts (`infos`) and
    every /diagnostics message (`diagnostics`)."""

    def __init__(self, name: str, cameras, joint_state_topic: str, joints,
                 engine=StandInEngine, cli_args=None, **parameters) -> None:
        import threading

        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.parameter import Parameter

        from molmobot_policy.ros.node import PolicyNode
        self.name = name
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        values = dict(autostart=False, camera_topics=list(cameras), joint_names=list(joints),
                      action_joint_names=list(joints), instruction='pick',
                      allow_random_weights=True, joint_state_topic=joint_state_topic,
                      chunk_period=0.2, control_period=0.05, diagnostics_period=0.2,
                      gc_freeze=False, camera_receiver='in_process')
        values.update(parameters)
        self.policy = PolicyNode(engine_factory=engine, node_name=name, context=self.context,
                                 cli_args=cli_args, parameter_overrides=[Parameter(k, value=v)
                                                      for k, v in values.items()])
        self.peer = rclpy.create_node(f'{name}_peer', context=self.context)
        self.lock = threading.Lock()
        self.infos, self.diagnostics = [], []
        self.peer.create_subscription(DiagnosticStatus, f'/{name}/chunk_info', self._on_info, 10)
        self.peer.create_subscription(DiagnosticArray, '/diagnostics', self._on_diagnostics, 10)
        publish_robot_inputs(self.peer, cameras, joint_state_topic, joints, period=0.05,
                             height=32, width=32,     # min_image_size's default
                             compressed=values.get('camera_transports') == ['compressed'])
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.policy)
        self.executor.add_node(self.peer)
        assert self.policy.autostart()
        self.thread = threading.Thread(target=self.spin, daemon=True)
        self.thread.start()

    def _on_info(self, msg):
        with self.lock:
            self.infos.append({kv.key: kv.value for kv in msg.values})

    def _on_diagnostics(self, msg):
        with self.lock:
            self.diagnostics.append(msg)
