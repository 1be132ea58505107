"""sensor_msgs/CompressedImage (image_transport 'compressed', jpeg / png) -> uint8 RGB, with the
same bad-input rules as raw images: a corrupt frame is refused, named, and raises ValueError;
and the publishers' encoder (`rgb_to_jpeg`, data for format JPEG_FORMAT)."""
from types import SimpleNamespace

import cv2
import numpy as np
import pytest

from molmobot_policy.ros.codec import JPEG_FORMAT, compressed_to_rgb, rgb_to_jpeg

RGB = np.zeros((4, 6, 3), np.uint8)
RGB[:, :3] = (200, 20, 10)       # reddish left half
RGB[:, 3:] = (10, 30, 220)       # bluish right half


def _msg(fmt, codec='.png', pixels_bgr=None):
    pixels_bgr = cv2.cvtColor(RGB, cv2.COLOR_RGB2BGR) if pixels_bgr is None else pixels_bgr
    ok, data = cv2.imencode(codec, pixels_bgr)
    assert ok
    return SimpleNamespace(format=fmt, data=data.tobytes())


@pytest.mark.parametrize('fmt', ['png', 'bgr8; png compressed bgr8', 'rgb8; png compressed bgr8'])
def test_png_in_opencv_channel_order_decodes_to_rgb_exactly(fmt):
    np.testing.assert_array_equal(compressed_to_rgb(_msg(fmt)), RGB)


def test_pixels_compressed_in_rgb_order_are_not_swapped():
    msg = _msg('rgb8; png compressed rgb8', pixels_bgr=RGB)   # bytes hold RGB order
    np.testing.assert_array_equal(compressed_to_rgb(msg), RGB)


def test_jpeg_decodes_to_rgb_within_compression_error():
    big = np.repeat(np.repeat(RGB, 16, axis=0), 16, axis=1)
    ok, data = cv2.imencode('.jpg', cv2.cvtColor(big, cv2.COLOR_RGB2BGR),
                            [cv2.IMWRITE_JPEG_QUALITY, 95])
    out = compressed_to_rgb(SimpleNamespace(format='rgb8; jpeg compressed bgr8',
                                            data=data.tobytes()))
    assert out.shape == big.shape and out.dtype == np.uint8
    assert np.abs(out[8:-8, 8:40].astype(int) - (200, 20, 10)).max() <= 12


def test_corrupt_jpeg_is_refused_naming_the_topic():
    msg = _msg('jpeg', codec='.jpg')
    msg.data = msg.data[:20]      # truncated
    with pytest.raises(ValueError, match=r"'/cam2/image_raw/compressed'.*corrupt or truncated"):
        compressed_to_rgb(msg, '/cam2/image_raw/compressed')


@pytest.mark.parametrize('fmt', ['16UC1; compressedDepth png', 'webp', ''])
def test_unsupported_format_is_refused_naming_it(fmt):
    with pytest.raises(ValueError, match='unsupported format'):
        compressed_to_rgb(SimpleNamespace(format=fmt, data=b'\x00'), '/cam0')


def test_empty_data_is_refused():
    with pytest.raises(ValueError, match='no data'):
        compressed_to_rgb(SimpleNamespace(format='jpeg', data=b''), '/cam0')


def test_the_encoder_writes_jpeg_in_bgr_order_as_its_format_says():
    big = np.repeat(np.repeat(RGB, 16, axis=0), 16, axis=1)
    data = rgb_to_jpeg(big, quality=95)
    assert data[:2] == b'\xff\xd8'                          # a JPEG start-of-image marker
    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)   # OpenCV: BGR
    assert np.abs(bgr[8:-8, 8:40].astype(int) - (10, 20, 200)).max() <= 12
    assert JPEG_FORMAT.endswith('compressed bgr8')
    out = compressed_to_rgb(SimpleNamespace(format=JPEG_FORMAT, data=data))
    assert np.abs(out[8:-8, 8:40].astype(int) - (200, 20, 10)).max() <= 12


@pytest.mark.parametrize('frame, quality, match', [
    (np.zeros((4, 6), np.uint8), 95, 'frame: expected uint8'),
    (np.zeros((4, 6, 3), np.float32), 95, 'frame: expected uint8'),
    (np.zeros((0, 6, 3), np.uint8), 95, 'frame: expected uint8'),
    (RGB, 0, 'quality: expected 1..100'),
    (RGB, 101, 'quality: expected 1..100')])
def test_the_encoder_refuses_bad_frames_and_qualities(frame, quality, match):
    with pytest.raises(ValueError, match=match):
        rgb_to_jpeg(frame, quality)
