"""Image resize + patchify and pooling indices (preprocess/images.py)."""
import numpy as np
import pytest
import torch

from molmobot_policy.preprocess.images import patchify, pooling_indices, resize_and_patchify


def test_output_is_729_patches_of_588_uint8():
    image = np.zeros((360, 640, 3), np.uint8)
    patches = resize_and_patchify(image)
    assert patches.shape == (729, 588)
    assert patches.dtype == np.uint8


def test_batched_torch_input_gives_torch_output_on_same_device():
    images = torch.zeros((3, 48, 64, 3), dtype=torch.uint8)
    patches = resize_and_patchify(images)
    assert isinstance(patches, torch.Tensor)
    assert patches.shape == (3, 729, 588)
    assert patches.dtype == torch.uint8
    assert patches.device == images.device


def test_numpy_and_torch_inputs_agree():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)
    from_numpy = resize_and_patchify(image)
    from_torch = resize_and_patchify(torch.from_numpy(image)[None])[0].numpy()
    np.testing.assert_array_equal(from_numpy, from_torch)


def test_patch_with_known_color_lands_at_its_row_and_col_in_rgb_order():
    # 378x378 input: the resize is the identity, so patch (row 3, col 5) is pixels
    # [42:56, 70:84] and patch index = 3 * 27 + 5.
    image = np.zeros((378, 378, 3), np.uint8)
    image[42:56, 70:84] = (10, 20, 30)
    patches = resize_and_patchify(image)
    expected = np.tile(np.array([10, 20, 30], np.uint8), 14 * 14)
    np.testing.assert_array_equal(patches[3 * 27 + 5], expected)
    others = np.delete(patches, 3 * 27 + 5, axis=0)
    assert not others.any()


def test_within_patch_order_is_dy_dx_channel():
    image = np.zeros((378, 378, 3), np.uint8)
    image[0, 1, 2] = 7     # patch 0, dy=0, dx=1, channel 2
    image[1, 0, 0] = 9     # patch 0, dy=1, dx=0, channel 0
    patches = resize_and_patchify(image)
    assert patches[0, (0 * 14 + 1) * 3 + 2] == 7
    assert patches[0, (1 * 14 + 0) * 3 + 0] == 9
    assert np.count_nonzero(patches) == 2


def test_resize_ignores_aspect_ratio_left_half_stays_left_half():
    image = np.zeros((100, 400, 3), np.uint8)
    image[:, :200] = 255
    patches = resize_and_patchify(image).reshape(27, 27, 14, 14, 3)
    assert (patches[:, :13] == 255).all()      # whole columns of patches, top to bottom
    assert (patches[:, 14:] == 0).all()


def test_resize_is_bilinear_without_antialias_half_to_even():
    # 2 -> 4 pixels along x (align_corners=False): output samples sit at source
    # x = -0.25, 0.25, 0.75, 1.25 (clamped): [a, 0.75a+0.25b, 0.25a+0.75b, b].
    # With a=0, b=2: [0, 0.5, 1.5, 2] -> round half to even -> [0, 0, 2, 2].
    image = np.zeros((4, 2, 3), np.uint8)
    image[:, 1] = 2
    patches = resize_and_patchify(image, image_size=4, patch_size=4)
    row = patches[0].reshape(4, 4, 3)[0, :, 0]
    np.testing.assert_array_equal(row, [0, 0, 2, 2])


def test_patchify_rejects_side_not_divisible_by_patch():
    with pytest.raises(ValueError, match='divisible'):
        patchify(torch.zeros((1, 20, 20, 3), dtype=torch.uint8), patch_size=14)


@pytest.mark.parametrize('bad, message', [
    (np.zeros((10, 10, 3), np.float32), 'uint8'),
    (np.zeros((10, 10, 4), np.uint8), '3 RGB channels'),
    (np.zeros((10, 10), np.uint8), '3 RGB channels'),
    (np.zeros((0, 10, 3), np.uint8), 'non-empty'),
    (torch.zeros((2, 10, 10, 3), dtype=torch.int64), 'uint8'),
])
def test_bad_images_are_rejected_with_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        resize_and_patchify(bad)


def test_non_array_images_are_rejected():
    with pytest.raises(TypeError, match='numpy array or a torch tensor'):
        resize_and_patchify([[1, 2, 3]])


def test_pooling_indices_shape_and_first_window():
    pooling = pooling_indices(1)
    assert pooling.shape == (196, 4)
    assert pooling.dtype == np.int64
    np.testing.assert_array_equal(pooling[0], [0, 1, 27, 28])


def test_pooling_indices_pad_bottom_and_right_with_minus_one():
    pooling = pooling_indices(1)
    np.testing.assert_array_equal(pooling[13], [26, -1, 53, -1])             # last column
    np.testing.assert_array_equal(pooling[13 * 14], [26 * 27, 26 * 27 + 1, -1, -1])  # last row
    np.testing.assert_array_equal(pooling[195], [26 * 27 + 26, -1, -1, -1])
    assert (pooling == -1).sum() == 14 * 2 + 14 * 2 - 1


def test_pooling_indices_cover_every_patch_once():
    pooling = pooling_indices(1)
    valid = np.sort(pooling[pooling >= 0])
    np.testing.assert_array_equal(valid, np.arange(729))


def test_pooling_indices_offset_each_image_by_729():
    pooling = pooling_indices(3)
    assert pooling.shape == (3 * 196, 4)
    for k in range(3):
        block = pooling[k * 196:(k + 1) * 196]
        expected = np.where(pooling[:196] >= 0, pooling[:196] + k * 729, -1)
        np.testing.assert_array_equal(block, expected)


@pytest.mark.parametrize('n', [0, -1, 1.5])
def test_pooling_indices_reject_bad_image_count(n):
    with pytest.raises(ValueError, match='n_images'):
        pooling_indices(n)
