"""preprocess layer of molmobot_policy (see docs/ARCHITECTURE.md): images -> uint8 patches,
text -> prompt ids, robot state/actions <-> quantile space, and the robot contract.
numpy/torch/tokenizers only; no rclpy."""
from molmobot_policy.preprocess.images import pooling_indices, resize_and_patchify
from molmobot_policy.preprocess.normalize import QuantileNormalizer, normalizers_from_config
from molmobot_policy.preprocess.pipeline import ModelInputs, Preprocessor
from molmobot_policy.preprocess.prompt import (PromptFitter, TextInputs, build_prompt_ids,
                                               image_token_positions)
from molmobot_policy.preprocess.tokenizer import TextTokenizer, load_tokenizer, tiny_tokenizer
from molmobot_policy.preprocess.transforms import RobotContract, RobotTransforms

__all__ = [
    'ModelInputs', 'Preprocessor', 'PromptFitter', 'QuantileNormalizer', 'RobotContract',
    'RobotTransforms', 'TextInputs', 'TextTokenizer', 'build_prompt_ids',
    'image_token_positions', 'load_tokenizer', 'normalizers_from_config', 'pooling_indices',
    'resize_and_patchify', 'tiny_tokenizer',
]
