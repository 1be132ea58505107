"""ros layer of molmobot_policy (see docs/ARCHITECTURE.md)."""
import os

# The process that started this one, read when the package is first imported (before rclpy and
# the node's imports, ~1 s): `ros.main`'s ParentWatch watches it. Read later, a parent that
# exited during those imports would already be replaced by init, and the orphan never seen.
START_PARENT = os.getppid()
