"""`Observation` -> the model's inputs on the serving device, and the model's actions -> robot
units: the serving path's input and output transforms (`runtime.engine.PolicyEngine` runs
them on every query; the golden preprocess tests certify them).

    images:      one per camera (contract) -> resize + patchify on the device (images.py)
    instruction: -> prompt ids, <im_patch> positions, pooling indices, padded (prompt.py)
    state:       -> pad + quantile normalize (transforms.py)
    actions:     -> unnormalize, gripper threshold (transforms.py)
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.preprocess.images import as_uint8_nhwc, resize_and_patchify
from molmobot_policy.preprocess.prompt import (TEXT_CACHE_SIZE, Encoder, PromptFitter,
                                               TextInputs)
from molmobot_policy.preprocess.transforms import RobotContract, RobotTransforms
from molmobot_policy.types import Observation

PINNED_BUFFERS = 4   # pinned upload buffers kept, one per (camera count, frame shape)


@dataclass(frozen=True)
class ModelInputs:
    """One query as the model takes it (batch of 1, tensors on the serving device).

    Attributes:
        input_ids: int64 (1, L). attention_mask: bool (1, L), False = padding.
        position_ids: int64 (1, L).
        image_positions: int64 (1, N*T), positions of `<im_patch>` in input_ids.
        token_pooling: int64 (1, N*T, pool), -1 = pad.
        images: uint8 (1, N, num_patches, patch_dim), not normalized (the model does
            x/255*2-1).
        states: float32 (1, 1, state_dim), quantile-normalized, zero-padded.
        text: the host-side `TextInputs` these came from (length, bucket).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    image_positions: torch.Tensor
    token_pooling: torch.Tensor
    images: torch.Tensor
    states: torch.Tensor
    text: TextInputs

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by name: the keyword arguments of the engine's query."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != 'text'}


class Preprocessor:
    """Builds `ModelInputs` from an `Observation`, and maps actions back to robot units.

    Args:
        model: the model config (image size and patch size, tokens, pooling, widths, stats).
        tokenizer: anything with `encode(text) -> list[int]` (`tokenizer.TextTokenizer`).
        contract: the robot contract; default `RobotContract.numbered(model.max_images,
            model.state_dim)`.
        buckets, overlong: prompt padding and over-long prompts (`prompt.PromptFitter`).
        device: where the images are resized and the inputs live.
    Raises:
        ValueError: the contract does not fit the model (`RobotContract.check`), bad
            norm_stats, buckets too small (`PromptFitter`).
    """

    def __init__(self, model: MolmoBotConfig, tokenizer: Encoder,
                 contract: RobotContract | None = None, *, buckets: tuple[int, ...] = (),
                 overlong: str = 'error', device: torch.device | str = 'cpu') -> None:
        if contract is None:
            contract = RobotContract.numbered(model.max_images, model.state_dim)
        self.contract = contract
        self.transforms = RobotTransforms(contract, model)
        self.prompt = PromptFitter(tokenizer, model, len(contract.camera_names), buckets,
                                   overlong)
        self.image_size, self.patch_size = model.vit.image_size, model.vit.patch_size
        self.device = torch.device(device)
        self._text_on_device = functools.lru_cache(maxsize=TEXT_CACHE_SIZE)(self._to_device)
        self._pinned: dict[tuple[int, ...], tuple[torch.Tensor, torch.cuda.Event]] = {}

    def text_inputs(self, instruction: str) -> TextInputs:
        """The host-side text inputs of `instruction` (`PromptFitter.text_inputs`, cached).
        Host only: safe from another thread while the engine serves."""
        return self.prompt.text_inputs(instruction)

    def _to_device(self, text: TextInputs) -> dict[str, torch.Tensor]:
        names = ('input_ids', 'attention_mask', 'position_ids', 'image_positions',
                 'token_pooling')
        return {name: torch.as_tensor(np.array(getattr(text, name)), device=self.device)[None]
                for name in names}

    def images(self, images: tuple[np.ndarray, ...]) -> torch.Tensor:
        """One uint8 RGB (H, W, 3) frame per camera, any sizes -> uint8 (1, N, num_patches,
        patch_dim) on the device (resized there).

        Frames of one size travel and are resized together: on a CUDA device they are copied
        into one pinned host buffer and uploaded in one asynchronous copy, then resized as one
        batch (the same per-pixel arithmetic as one at a time, so the same bits), instead of a
        pageable copy and a chain of resize kernels per camera: host time before the model
        starts (docs/decisions/query-host-path.md).

        Raises:
            ValueError: not one image per camera; an image that is not uint8 (H, W, 3),
                naming its camera.
        """
        self.contract.check_camera_count(len(images))
        frames = []
        for name, image in zip(self.contract.camera_names, images):
            try:
                frame, single = as_uint8_nhwc(image)
                if not single:
                    raise ValueError('expected one image of shape (H, W, 3), got shape '
                                     f'{tuple(frame.shape)}')
            except (TypeError, ValueError) as error:
                raise ValueError(f'image of camera {name!r}: {error}') from None
            frames.append(frame[0])
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for index, frame in enumerate(frames):
            by_shape.setdefault((tuple(frame.shape), frame.device), []).append(index)
        groups = [(indices, resize_and_patchify(self._upload([frames[i] for i in indices]),
                                                self.image_size, self.patch_size))
                  for indices in by_shape.values()]
        if len(groups) == 1:
            return groups[0][1][None]
        out = torch.empty((len(frames), *groups[0][1].shape[1:]), dtype=torch.uint8,
                          device=self.device)
        for indices, patches in groups:
            out[indices] = patches
        return out[None]

    def _upload(self, frames: list[torch.Tensor]) -> torch.Tensor:
        """Frames of one shape (H, W, 3) uint8, on one device -> uint8 (n, H, W, 3) on the
        serving device. From the host to a CUDA device through a pinned buffer kept per
        shape; the buffer is rewritten only after its last upload has finished (an event)."""
        if self.device.type != 'cuda' or frames[0].device.type != 'cpu':
            return torch.stack(frames).to(self.device, non_blocking=True)
        key = (len(frames), *frames[0].shape)
        staged = self._pinned.get(key)
        if staged is None:
            if len(self._pinned) >= PINNED_BUFFERS:
                self._pinned.clear()    # camera sizes changed; the next query re-pins
            with torch.inference_mode(False):    # a normal tensor: rewritable in and out
                staged = (torch.empty(key, dtype=torch.uint8, pin_memory=True),
                          torch.cuda.Event())
            self._pinned[key] = staged
        buffer, uploaded = staged
        uploaded.synchronize()          # the previous upload from this buffer is done
        view = buffer.numpy()
        for j, frame in enumerate(frames):
            # numpy's copy, on this thread: torch's CPU copy runs on the intra-op thread
            # pool, whose wake-ups now and then held a query back by a whole inference
            np.copyto(view[j], frame.numpy())
        batch = buffer.to(self.device, non_blocking=True)
        uploaded.record()
        return batch

    def inputs(self, text: TextInputs, images: tuple[np.ndarray, ...],
               state: np.ndarray) -> ModelInputs:
        """`ModelInputs` from text inputs (e.g. a warm-up probe, `PromptFitter.pad`), frames and
        the raw state (`RobotTransforms.normalize_state`). ValueError as `images` and there."""
        states = torch.as_tensor(self.transforms.normalize_state(state), device=self.device)
        return ModelInputs(**self._text_on_device(text), images=self.images(images),
                           states=states.reshape(1, 1, -1), text=text)

    def __call__(self, observation: Observation, instruction: str | None = None) -> ModelInputs:
        """Observation -> ModelInputs. instruction: overrides `observation.instruction` (the
        engine passes its default when the observation carries none).

        Raises:
            TypeError, ValueError: a wrong image count, a bad image, a state that does not fit
                the contract, an empty or (with overlong='error') too long instruction.
        """
        text = self.text_inputs(observation.instruction if instruction is None
                                else instruction)
        return self.inputs(text, observation.images, observation.state)

    def postprocess(self, actions_normalized: np.ndarray) -> np.ndarray:
        """Model output float (H, action_dim) -> float32 (H, action_dim) robot units
        (`RobotTransforms.postprocess`). ValueError on shape."""
        return self.transforms.postprocess(actions_normalized)
