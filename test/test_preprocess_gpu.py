"""The query's frames on a CUDA device (`preprocess.pipeline.Preprocessor.images`): copied into
one pinned buffer per frame shape, uploaded in one copy and resized as one batch, they give
the patches of the CPU path (certified against upstream by test_golden_preprocess), camera
by camera, in and out of inference mode, and a second query does not overwrite the first's
upload before it has happened.

Skipped without CUDA (CPU CI); run on the H200 (docs/PERFORMANCE.md, "GPU tests")."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from molmobot_policy.model.config import MolmoBotConfig
from molmobot_policy.preprocess.images import resize_and_patchify
from molmobot_policy.preprocess.pipeline import Preprocessor
from molmobot_policy.preprocess.tokenizer import tiny_tokenizer
from molmobot_policy.preprocess.transforms import RobotContract

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')

TINY = MolmoBotConfig.from_name('tiny')
CAMERAS = ['a', 'b', 'c', 'd']


@pytest.fixture
def preprocessor():
    contract = RobotContract(camera_names=CAMERAS, joint_names=[f'j{i}' for i in range(8)])
    return Preprocessor(TINY, tiny_tokenizer(TINY.tokens), contract, device='cuda')


def frames(seed: int, shapes) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return tuple(rng.integers(0, 256, shape, dtype=np.uint8) for shape in shapes)


def check(got: torch.Tensor, images) -> None:
    assert got.device.type == 'cuda' and got.shape == (1, len(images), 729, 588)
    for k, image in enumerate(images):
        np.testing.assert_array_equal(got[0, k].cpu().numpy(), resize_and_patchify(image),
                                      err_msg=f'camera {CAMERAS[k]}')


def test_mixed_sizes_give_the_cpu_patches_in_camera_order(preprocessor):
    images = frames(0, [(480, 640, 3), (240, 320, 3), (480, 640, 3), (240, 320, 3)])
    check(preprocessor.images(images), images)


def test_the_pinned_buffer_serves_in_and_out_of_inference_mode(preprocessor):
    first = frames(1, [(480, 640, 3)] * 4)
    with torch.inference_mode():     # the buffer is made here ...
        check(preprocessor.images(first), first)
    second = frames(2, [(480, 640, 3)] * 4)
    check(preprocessor.images(second), second)     # ... and rewritten here


def test_back_to_back_queries_keep_their_own_frames(preprocessor):
    # the second query rewrites the pinned buffer while the first's upload may still be
    # queued behind other GPU work: it must wait for it
    busy = torch.randn(4096, 4096, device='cuda')
    queries = [frames(10 + i, [(480, 640, 3)] * 4) for i in range(4)]
    results = []
    for images in queries:
        for _ in range(8):
            busy = busy @ busy.T * 1e-4          # keep the stream busy
        results.append(preprocessor.images(images))
    for got, images in zip(results, queries):
        check(got, images)
