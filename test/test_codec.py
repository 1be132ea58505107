"""ros/codec.py: sensor_msgs/Image -> uint8 RGB, on duck-typed messages (no ROS graph)."""
import array
from types import SimpleNamespace

import numpy as np
import pytest

from molmobot_policy.ros.codec import image_to_rgb

HEIGHT, WIDTH = 5, 7


def _rgb():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(HEIGHT, WIDTH, 3), dtype=np.uint8)


def _message(pixels, encoding, padding=0, data_type=bytes):
    """An Image-like message whose rows carry `padding` extra bytes (filled with 0xAB)."""
    pixels = pixels.reshape(pixels.shape[0], pixels.shape[1], -1)
    rows = pixels.reshape(pixels.shape[0], -1)
    padded = np.concatenate([rows, np.full((rows.shape[0], padding), 0xAB, np.uint8)], axis=1)
    data = padded.tobytes()
    if data_type is array.array:
        data = array.array('B', data)
    elif data_type is list:
        data = list(data)
    return SimpleNamespace(height=pixels.shape[0], width=pixels.shape[1], encoding=encoding,
                           step=padded.shape[1], data=data, is_bigendian=1)


def test_rgb8_is_returned_unchanged():
    rgb = _rgb()
    out = image_to_rgb(_message(rgb, 'rgb8'))
    assert out.dtype == np.uint8 and out.shape == (HEIGHT, WIDTH, 3)
    np.testing.assert_array_equal(out, rgb)


def test_bgr8_channels_are_swapped_to_rgb():
    rgb = _rgb()
    np.testing.assert_array_equal(image_to_rgb(_message(rgb[:, :, ::-1], 'bgr8')), rgb)


def test_rgba8_drops_alpha():
    rgb = _rgb()
    rgba = np.concatenate([rgb, np.full((HEIGHT, WIDTH, 1), 7, np.uint8)], axis=2)
    np.testing.assert_array_equal(image_to_rgb(_message(rgba, 'rgba8')), rgb)


def test_bgra8_swaps_channels_and_drops_alpha():
    rgb = _rgb()
    bgra = np.concatenate([rgb[:, :, ::-1], np.full((HEIGHT, WIDTH, 1), 9, np.uint8)], axis=2)
    np.testing.assert_array_equal(image_to_rgb(_message(bgra, 'bgra8')), rgb)


def test_mono8_is_replicated_to_three_channels():
    mono = _rgb()[:, :, 0]
    out = image_to_rgb(_message(mono, 'mono8'))
    np.testing.assert_array_equal(out, np.stack([mono] * 3, axis=2))


@pytest.mark.parametrize('encoding', ['rgb8', 'bgr8', 'rgba8', 'bgra8', 'mono8'])
def test_row_padding_from_step_is_ignored(encoding):
    rgb = _rgb()
    pixels = {'rgb8': rgb, 'bgr8': rgb[:, :, ::-1],
              'rgba8': np.concatenate([rgb, rgb[:, :, :1]], axis=2),
              'bgra8': np.concatenate([rgb[:, :, ::-1], rgb[:, :, :1]], axis=2),
              'mono8': rgb[:, :, :1]}[encoding]
    expected = image_to_rgb(_message(pixels, encoding))
    out = image_to_rgb(_message(pixels, encoding, padding=5))
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize('data_type', [bytes, array.array, list])
def test_data_may_be_bytes_array_or_list(data_type):
    rgb = _rgb()
    np.testing.assert_array_equal(image_to_rgb(_message(rgb, 'rgb8', data_type=data_type)), rgb)


def test_result_owns_its_memory_and_is_contiguous():
    msg = _message(_rgb(), 'rgb8', padding=3, data_type=array.array)
    out = image_to_rgb(msg)
    assert out.flags.c_contiguous and out.flags.owndata
    msg.data[0] = (msg.data[0] + 1) % 256
    assert out[0, 0, 0] != msg.data[0]


def test_unsupported_encoding_names_topic_and_encoding():
    msg = _message(_rgb(), 'rgb8')
    msg.encoding = '16UC1'
    with pytest.raises(ValueError, match=r"/cam3/image_raw.*'16UC1'.*rgb8"):
        image_to_rgb(msg, topic='/cam3/image_raw')


def test_wrong_data_length_names_expected_size():
    msg = _message(_rgb(), 'rgb8')
    msg.data = msg.data[:-1]
    with pytest.raises(ValueError, match=rf'/cam0.*rgb8.*{WIDTH * 3 * HEIGHT - 1} bytes.*'
                                         rf'{WIDTH * 3} \* {HEIGHT} = {WIDTH * 3 * HEIGHT}'):
        image_to_rgb(msg, topic='/cam0')


def test_step_smaller_than_row_is_rejected():
    msg = _message(_rgb(), 'bgr8')
    msg.step = WIDTH * 3 - 1
    with pytest.raises(ValueError, match=rf'step {WIDTH * 3 - 1}.*{WIDTH} \* 3'):
        image_to_rgb(msg, topic='/cam1')


def test_zero_size_is_rejected():
    msg = SimpleNamespace(height=0, width=4, encoding='rgb8', step=12, data=b'')
    with pytest.raises(ValueError, match='size must be positive'):
        image_to_rgb(msg)
