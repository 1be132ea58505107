"""sim layer of molmobot_policy_demo (see docs/ARCHITECTURE.md): the demo world.

- `sim.scene`: `JacoScene`, the Kinova Jaco arm on a table with cubes and 8 cameras
  (MuJoCo + dm_control, headless rendering, no rclpy).
- `sim.trajectory`: pure functions for following `trajectory_msgs/JointTrajectory` values.
- `sim.robot_node`: the `sim_robot` ROS 2 node (rclpy).
"""
