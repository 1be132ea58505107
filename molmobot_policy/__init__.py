"""molmobot_policy: ROS 2 policy node for the MolmoBot vision-language-action model."""
__version__ = "0.1.0"
