"""`Observation` -> the model's numpy inputs, and the model's actions -> robot units.

The CPU path (`Preprocessor.__call__`) does everything on the host. The runtime resizes
images on the GPU itself and only asks for the text side (`Preprocessor.text_inputs`),
which depends on the instruction and the camera count alone and is cached.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.preprocess.images import pooling_indices, resize_and_patchify
from molmobot_policy.preprocess.prompt import Encoder, build_prompt_ids, image_token_positions
from molmobot_policy.preprocess.transforms import RobotContract
from molmobot_policy.types import Observation

TEXT_CACHE_SIZE = 64     # distinct (instruction, camera count) prompts kept


@dataclass(frozen=True)
class TextInputs:
    """The instruction-dependent half of a query (read-only arrays, shared by the cache).

    Attributes:
        input_ids: int64 (L,) token ids.
        image_positions: int64 (N*196,) positions of `<im_patch>` in input_ids.
        token_pooling: int64 (N*196, 4) patch indices per image token, -1 = pad.
    """

    input_ids: np.ndarray
    image_positions: np.ndarray
    token_pooling: np.ndarray


@dataclass(frozen=True)
class ModelInputs:
    """One query as the model takes it (batch of 1, numpy).

    Attributes:
        input_ids: int64 (1, L).
        images: uint8 (1, N, 729, 588) patches, not normalized (the model does x/255*2-1).
        token_pooling: int64 (1, N*196, 4), -1 = pad.
        image_positions: int64 (1, N*196), positions of `<im_patch>` in input_ids.
        states: float32 (1, 1, state_dim), quantile-normalized, zero-padded.
    """

    input_ids: np.ndarray
    images: np.ndarray
    token_pooling: np.ndarray
    image_positions: np.ndarray
    states: np.ndarray


def _read_only(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


class Preprocessor:
    """Builds `ModelInputs` from an `Observation`, and maps actions back to robot units.

    Args:
        cfg: the model config (vit sizes, tokens, max_images, state/action widths).
        tokenizer: anything with `encode(text) -> list[int]` (`tokenizer.TextTokenizer`).
        contract: the robot contract, which owns the quantile normalizers and the gripper
            threshold; default `RobotContract.from_config(cfg)` (cfg.max_images cameras,
            cfg.state_dim joints).
    Raises:
        ValueError: from `RobotContract.from_config` when no contract is given.
    """

    def __init__(self, cfg: MolmoBotConfig, tokenizer: Encoder,
                 contract: RobotContract | None = None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.contract = contract if contract is not None else RobotContract.from_config(cfg)
        self._text_cache: OrderedDict[tuple[str, int], TextInputs] = OrderedDict()

    def text_inputs(self, instruction: str, n_images: int) -> TextInputs:
        """Prompt ids, `<im_patch>` positions and pooling indices; cached per
        (instruction, n_images), least recently used evicted after TEXT_CACHE_SIZE.

        Raises:
            TypeError, ValueError: see `prompt.build_prompt_ids` (empty instruction,
                n_images outside 2..max_images).
        """
        key = (instruction, n_images)
        cached = self._text_cache.get(key)
        if cached is not None:
            self._text_cache.move_to_end(key)
            return cached
        cfg = self.cfg
        ids = build_prompt_ids(self.tokenizer, cfg.tokens, n_images, cfg.tokens_per_image,
                               instruction, max_images=cfg.max_images)
        text = TextInputs(
            input_ids=_read_only(ids),
            image_positions=_read_only(image_token_positions(ids, cfg.tokens)),
            token_pooling=_read_only(pooling_indices(n_images, cfg.vit.grid,
                                                     cfg.connector.pooling_h,
                                                     cfg.connector.pooling_w)))
        self._text_cache[key] = text
        if len(self._text_cache) > TEXT_CACHE_SIZE:
            self._text_cache.popitem(last=False)
        return text

    def __call__(self, observation: Observation) -> ModelInputs:
        """Observation -> ModelInputs, all on the CPU.

        Raises:
            ValueError: the image count differs from the contract's cameras; an image is
                not uint8 (H, W, 3); the state does not fit the contract; the
                instruction is empty.
        """
        n_cameras = len(self.contract.camera_names)
        if len(observation.images) != n_cameras:
            raise ValueError(f'observation has {len(observation.images)} images, the robot '
                             f'contract has {n_cameras} cameras {list(self.contract.camera_names)}')
        text = self.text_inputs(observation.instruction, n_cameras)
        images = []
        for name, image in zip(self.contract.camera_names, observation.images):
            try:
                images.append(resize_and_patchify(image, self.cfg.vit.image_size,
                                                  self.cfg.vit.patch_size))
            except (TypeError, ValueError) as error:
                raise ValueError(f'image of camera {name!r}: {error}') from None
        states = self.contract.normalize_state(observation.state)
        return ModelInputs(
            input_ids=np.array(text.input_ids)[None],
            images=np.stack(images)[None],
            token_pooling=np.array(text.token_pooling)[None],
            image_positions=np.array(text.image_positions)[None],
            states=states.reshape(1, 1, -1))

    def postprocess(self, actions_normalized: np.ndarray) -> np.ndarray:
        """Model output float (H, action_dim) -> float32 (H, action_dim) robot units
        (quantile unnormalize, then the contract's gripper threshold). ValueError on shape.
        """
        return self.contract.postprocess(actions_normalized)
