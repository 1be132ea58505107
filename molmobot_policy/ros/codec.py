"""sensor_msgs/Image or CompressedImage -> uint8 RGB frame, the only image format the model
side accepts; and the reverse for publishers (`rgb_to_jpeg`: the sim robot, the benchmarks).

Pure functions on duck-typed messages (fields `height`, `width`, `encoding`, `step`,
`data`; or `format`, `data`), so unit tests need no ROS graph. Encoding names are those of ROS REP 118 /
`sensor_msgs/image_encodings.hpp`. Only 8-bit encodings are supported, for which
`is_bigendian` does not matter.
"""
from __future__ import annotations

import cv2
import numpy as np

# encoding -> (channels, cv2 conversion to RGB or None when already RGB)
_ENCODINGS = {
    'rgb8': (3, None),
    'bgr8': (3, cv2.COLOR_BGR2RGB),
    'rgba8': (4, cv2.COLOR_RGBA2RGB),
    'bgra8': (4, cv2.COLOR_BGRA2RGB),
    'mono8': (1, cv2.COLOR_GRAY2RGB),
    '8UC1': (1, cv2.COLOR_GRAY2RGB),
    '8UC3': (3, None),
}

SUPPORTED_ENCODINGS = tuple(_ENCODINGS)


def image_to_rgb(msg, topic: str = '') -> np.ndarray:
    """Decode one image message into a contiguous RGB frame.

    Args:
        msg: a `sensor_msgs/msg/Image` (or any object with the same fields): `height`,
            `width` (pixels), `encoding` (one of SUPPORTED_ENCODINGS; '8UC3' is read as
            RGB), `step` (bytes per row, >= width * channels; rows may be padded), `data`
            (bytes, bytearray, array.array('B') or a sequence of ints, length step * height).
        topic: the topic the message came from, used only in error messages.

    Returns:
        np.uint8 array (height, width, 3), RGB order, C-contiguous, owning its memory.

    Raises:
        ValueError: unsupported encoding, zero size, `step` smaller than width * channels,
            or `data` whose length is not step * height. The message names the topic, the
            encoding and the expected sizes.
    """
    where = f'image on {topic!r}' if topic else 'image'
    encoding = msg.encoding
    if encoding not in _ENCODINGS:
        raise ValueError(f'{where}: unsupported encoding {encoding!r}; expected one of '
                         f'{list(SUPPORTED_ENCODINGS)}')
    channels, conversion = _ENCODINGS[encoding]
    height, width, step = int(msg.height), int(msg.width), int(msg.step)
    if height <= 0 or width <= 0:
        raise ValueError(f'{where} ({encoding}): size must be positive, got '
                         f'height={height} width={width}')
    row_bytes = width * channels
    if step < row_bytes:
        raise ValueError(f'{where} ({encoding}): step {step} is smaller than width * channels '
                         f'= {width} * {channels} = {row_bytes}')
    data = msg.data
    if isinstance(data, (bytes, bytearray, memoryview)) or hasattr(data, 'typecode'):
        buffer = np.frombuffer(data, dtype=np.uint8)
    else:
        buffer = np.asarray(data, dtype=np.uint8)
    if buffer.size != step * height:
        raise ValueError(f'{where} ({encoding}): data has {buffer.size} bytes, expected '
                         f'step * height = {step} * {height} = {step * height}')
    pixels = buffer.reshape(height, step)[:, :row_bytes].reshape(height, width, channels)
    if conversion is None:
        return np.array(pixels, dtype=np.uint8, order='C')
    if channels == 1:
        pixels = pixels[:, :, 0]
    return cv2.cvtColor(np.ascontiguousarray(pixels), conversion)


COMPRESSED_FORMATS = ('jpeg', 'png')


def compressed_to_rgb(msg, topic: str = '') -> np.ndarray:
    """Decode one sensor_msgs/CompressedImage (image_transport's `compressed` plugin) to RGB.

    Args:
        msg: an object with `format` (str) and `data` (bytes-like). `format` is 'jpeg' or
            'png', or image_transport's long form '<encoding>; <jpeg|png> compressed
            <encoding>' (e.g. 'rgb8; jpeg compressed bgr8'): the encoding after 'compressed'
            says the channel order of the compressed pixels (bgr8 when absent, OpenCV's).
        topic: the topic, used only in error messages.

    Returns:
        np.uint8 array (height, width, 3), RGB order, C-contiguous (grey images replicated).

    Raises:
        ValueError: a format other than jpeg / png (e.g. compressedDepth), empty data, or data
            OpenCV cannot decode (corrupt or truncated); the message names the topic and format.
    """
    where = f'compressed image on {topic!r}' if topic else 'compressed image'
    fmt = str(msg.format).strip()
    kind, _, after = fmt.partition(' compressed ')
    codec = kind.split(';')[-1].strip().lower()
    if codec not in COMPRESSED_FORMATS or 'compresseddepth' in fmt.lower():
        raise ValueError(f'{where}: unsupported format {fmt!r}; expected jpeg or png (image_'
                         "transport 'compressed', e.g. 'rgb8; jpeg compressed bgr8')")
    data = np.frombuffer(bytes(msg.data), dtype=np.uint8)
    if data.size == 0:
        raise ValueError(f'{where} ({fmt}): no data')
    pixels = cv2.imdecode(data, cv2.IMREAD_COLOR)
    if pixels is None:
        raise ValueError(f'{where} ({fmt}): {data.size} bytes could not be decoded as {codec} '
                         '(corrupt or truncated)')
    if after.strip().lower().startswith('rgb'):     # pixels were compressed in RGB order
        return np.ascontiguousarray(pixels)
    return cv2.cvtColor(pixels, cv2.COLOR_BGR2RGB)


JPEG_FORMAT = 'rgb8; jpeg compressed bgr8'   # CompressedImage.format of `rgb_to_jpeg`'s data


def rgb_to_jpeg(frame: np.ndarray, quality: int = 95) -> bytes:
    """Encode an RGB frame as the `data` of a sensor_msgs/CompressedImage whose `format` is
    JPEG_FORMAT (image_transport's `compressed` plugin: jpeg of the frame in bgr8 order).

    Args:
        frame: np.uint8 (height, width, 3), RGB order.
        quality: jpeg quality, 1..100 (OpenCV's IMWRITE_JPEG_QUALITY; 95 is its default).

    Raises:
        ValueError: `frame` not uint8 (H, W, 3) of positive size, or `quality` outside 1..100.
        RuntimeError: OpenCV failed to encode the frame.
    """
    frame = np.asarray(frame)
    if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3 or not frame.size:
        raise ValueError(f'frame: expected uint8 (height, width, 3) RGB, got {frame.dtype} '
                         f'{frame.shape}')
    if not 1 <= int(quality) <= 100:
        raise ValueError(f'quality: expected 1..100, got {quality!r}')
    ok, data = cv2.imencode('.jpg', cv2.cvtColor(frame, cv2.COLOR_RGB2BGR),
                            [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
    if not ok:
        raise RuntimeError(f'jpeg encoding failed for a {frame.shape} frame')
    return data.tobytes()


def decode_image(msg, topic: str = '') -> np.ndarray:
    """A sensor_msgs/Image (`image_to_rgb`) or sensor_msgs/CompressedImage (`compressed_to_rgb`,
    told apart by its `format` field) -> uint8 (H, W, 3) RGB. Raises ValueError as those do."""
    if hasattr(msg, 'format'):
        return compressed_to_rgb(msg, topic)
    return image_to_rgb(msg, topic)
