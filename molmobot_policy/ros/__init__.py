"""ros layer of molmobot_policy (see docs/ARCHITECTURE.md)."""
