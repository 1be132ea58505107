"""molmobot_policy_demo: the simulated Jaco robot and `make demo`'s runner for molmobot_policy.

A package of its own so that a robot's workspace builds and installs the policy node alone
(docs/decisions/demo-package.md); it imports molmobot_policy, never the other way round.
"""
__version__ = "0.1.0"
