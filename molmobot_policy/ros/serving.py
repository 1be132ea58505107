"""What the policy node serves, checked at configure before any weights load.

- `served_weights`: the one line every start logs and /diagnostics carries: the checkpoint
  and a fingerprint of its weight files (`model.provenance`), or RANDOM WEIGHTS with the
  preset and seed, which the node serves only when `allow_random_weights` says so (an empty
  or missing `checkpoint_path` must never put random weights on a robot unnoticed).
- `read_model_config`: the model's config without the weights (config.yaml or the preset).
- `check_robot_contract`: the robot's parameters (cameras, joints, gripper) against it.
"""
from __future__ import annotations

RANDOM_WEIGHTS = 'RANDOM WEIGHTS'       # how `served_weights` names an untrained model


def default_engine_factory(config: dict):
    """`runtime.engine.PolicyEngine` of the EngineConfig fields in `config` and its 'contract'
    (imported only when used)."""
    from molmobot_policy.runtime.engine import EngineConfig, PolicyEngine
    options = dict(config)
    contract = options.pop('contract')
    return PolicyEngine(EngineConfig(**options), contract=contract)


def served_weights(engine_config: dict, allow_random_weights: bool) -> str:
    """What the engine of `engine_config` (checkpoint_path, model, seed) serves, as one line:
    'checkpoint <path> (weights fingerprint <12 hex digits>)' or 'RANDOM WEIGHTS (preset
    <model>, seed <seed>)'.

    Raises:
        ValueError: checkpoint_path is empty and allow_random_weights is false (the message
            says how to pass a checkpoint).
        FileNotFoundError: checkpoint_path has no weight files.
    """
    path = engine_config['checkpoint_path']
    if path:
        from molmobot_policy.model.provenance import weights_fingerprint
        return f'checkpoint {path} (weights fingerprint {weights_fingerprint(path)})'
    if not allow_random_weights:
        raise ValueError(
            "checkpoint_path is empty: set it to the checkpoint directory (config.yaml + "
            "model.pt or *.safetensors, README 'Checkpoints') in the parameter file or with "
            "`--ros-args -p checkpoint_path:=/path/to/checkpoint`; to serve random weights on "
            'purpose (tests, the demo) set allow_random_weights: true')
    return f"{RANDOM_WEIGHTS} (preset {engine_config['model']}, seed {engine_config['seed']})"


def serves_random_weights(served: str) -> bool:
    """True when `served` (a `served_weights` line) says RANDOM WEIGHTS."""
    return served.startswith(RANDOM_WEIGHTS)


def read_model_config(engine_config: dict):
    """The engine's model config without building the engine: the checkpoint's config.yaml
    (weights not read) or the preset. Raises FileNotFoundError / ValueError."""
    from molmobot_policy.model.checkpoint import load_config
    from molmobot_policy.model.config import MolmoBotConfig
    if engine_config['checkpoint_path']:
        return load_config(engine_config['checkpoint_path'],
                           norm_stats_key=engine_config['norm_stats_key'] or None)
    if engine_config['norm_stats_key']:
        raise ValueError(f"norm_stats_key={engine_config['norm_stats_key']!r} needs a "
                         'checkpoint_path (presets carry one set of stats)')
    return MolmoBotConfig.from_name(engine_config['model'])


def check_robot_contract(model, camera_topics, joint_names, action_joint_names,
                         gripper_index: int = -1, gripper_threshold: float = 0.0,
                         gripper_open: float = 0.0, gripper_closed: float = 1.0):
    """The robot's parameters as a `preprocess.transforms.RobotContract` (camera k -> image k,
    joints -> the state, action dim k -> action joint k, the gripper), checked against the
    model (`MolmoBotConfig`). Raises ValueError naming the parameter (`RobotContract.check`)."""
    from molmobot_policy.preprocess.transforms import RobotContract
    contract = RobotContract(camera_names=tuple(camera_topics), joint_names=tuple(joint_names),
                             action_joint_names=tuple(action_joint_names),
                             gripper_index=gripper_index, gripper_threshold=gripper_threshold,
                             gripper_open=gripper_open, gripper_closed=gripper_closed)
    contract.check(model)
    return contract
