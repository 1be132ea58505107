"""Newest camera frame per camera in shared memory, written by one process and read by another
(no rclpy): the policy node's `camera_receiver: subprocess` (`ros.camera_receiver`).

One `multiprocessing.shared_memory` segment holds one slot per camera. A slot is its sequence
number (SEQ_BYTES), a header (HEADER struct), RECENT receive times (float64, s, a ring indexed
by the message count: the rate statistics of the messages the reader never sees, since only
the newest frame is kept) and `capacity` bytes of message data: the raw image data
(Image.data, `step` bytes per row) or the compressed bytes (CompressedImage.data). The writer
overwrites the slot with every message; the reader copies the newest one out.

Consistency (a seqlock, one writer per slot): the writer makes the slot's sequence number
odd, writes header, receive time and data, then makes it even again; the reader reads the
sequence number, copies, reads it again and retries when it was odd or changed (a torn read:
the writer overwrote the slot meanwhile). `_fence` orders the accesses on each side: an
uncontended lock acquire and release, whose atomic instructions carry full memory barriers
(needed on weakly ordered CPUs, aarch64; x86-64 orders plain stores and loads anyway).

The sequence number is read and written only whole, as one aligned 8-byte word (a memoryview
cast to 'Q', native byte order: both processes run on one machine), never with `struct`:
`struct.pack_into` zero-fills its span before packing the values (CPython's _struct.c), so a
sequence number packed with it passes through 0, an even value; a reader that read that 0
before and after its copy took a frame overwritten mid-copy for whole (seen as ~1 torn frame
in 1000 reads of 1 MiB frames on a 2-core machine).

A message larger than `capacity` is not written: the slot records its size (`length` >
capacity) and the reader's `RawFrame` / `CompressedFrame` raises ValueError on `data`, so
the frame is refused where frames are decoded (`ObservationSynchronizer.build`) with that
reason.
"""
from __future__ import annotations

import os
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing import shared_memory

SEQ_BYTES = 8               # the sequence number: one uint64 word at the start of the slot
# after it: count (uint64: messages written), stamp (float64, header stamp s), received
# (float64, receive time s, the writer's clock), length (uint64 bytes of data), height, width,
# step (uint32), compressed (uint8), text length (uint8), text (encoding of a raw image or
# format of a compressed one, ascii)
HEADER = struct.Struct('<QddQIIIBB126s')
TEXT_BYTES = 126
RECENT = 32                         # receive times kept per slot (the synchronizer's rate
                                    # window is 30)
_RECENT = struct.Struct(f'<{RECENT}d')
SLOT_ALIGN = 64
DEFAULT_CAPACITY = 8 * 1024 * 1024  # bytes of message data per camera: a 1920 x 1080 rgb8
                                    # frame (6.2 MB) fits; pages are only committed once
                                    # written, so the unused rest costs no memory
READ_WAIT_S = 0.005                 # a read retries a slot being written (or torn) for up
                                    # to this long: a write copies a frame in ~0.1-2 ms (921 KB
                                    # to 6 MB); giving up sooner (100 quick tries, ~30 us) left
                                    # ~5 % of 8-camera observations with one frame a tick old
SEGMENT_PREFIX = 'molmobot_frames_'

_barrier = threading.Lock()
_TORN = object()        # `FrameSlots._read_once`: the slot changed under the read, try again


def _fence() -> None:
    """A full memory barrier (see the module docstring)."""
    with _barrier:
        pass


def _load_seq(buffer: memoryview, offset: int) -> int:
    """The sequence number of the slot at `offset`, read as one word (see the module
    docstring)."""
    return buffer[offset:offset + SEQ_BYTES].cast('Q')[0]


def _store_seq(buffer: memoryview, offset: int, seq: int) -> None:
    """Write the sequence number of the slot at `offset` as one word."""
    buffer[offset:offset + SEQ_BYTES].cast('Q')[0] = seq


class _SlotData:
    """`data` of a frame read from a slot: `data_`, or ValueError(`too_large`) for a message
    that did not fit its slot."""

    @property
    def data(self) -> bytes:
        if self.too_large:
            raise ValueError(self.too_large)
        return self.data_


@dataclass(frozen=True)
class RawFrame(_SlotData):
    """A sensor_msgs/Image's fields as `ros.codec.image_to_rgb` reads them (height, width:
    pixels; step: bytes per row; encoding: e.g. 'rgb8'; data: bytes)."""
    height: int
    width: int
    encoding: str
    step: int
    data_: bytes
    too_large: str = ''


@dataclass(frozen=True)
class CompressedFrame(_SlotData):
    """A sensor_msgs/CompressedImage's fields as `ros.codec.compressed_to_rgb` reads them
    (format: e.g. 'rgb8; jpeg compressed bgr8'; data: bytes)."""
    format: str
    data_: bytes
    too_large: str = ''


@dataclass(frozen=True)
class SlotFrame:
    """One consistent snapshot of a slot.

    Attributes:
        count: messages written to the slot so far (this one included).
        stamp: header stamp, s. received: receive time, s (the writer's clock).
        message: a `RawFrame` or `CompressedFrame` (for `ros.codec.decode_image`).
        earlier_receives: receive times (s, oldest first) of the messages written after
            the one the caller saw last (`since` of `FrameSlots.read`) and before this one,
            at most RECENT - 1 of them.
    """
    count: int
    stamp: float
    received: float
    message: RawFrame | CompressedFrame
    earlier_receives: tuple[float, ...]


def slot_bytes(capacity: int) -> int:
    """Bytes one slot of `capacity` data bytes takes (sequence number, header, receive times,
    data; aligned)."""
    size = SEQ_BYTES + HEADER.size + _RECENT.size + capacity
    return -(-size // SLOT_ALIGN) * SLOT_ALIGN


class FrameSlots:
    """`slots` frame slots of `capacity` data bytes in one shared-memory segment.

    `create` makes a new segment with a unique name (the owner unlinks it: `unlink`);
    `attach` opens an existing one by name (another process). One writer per slot; any
    number of readers.

    Raises:
        ValueError: slots < 1, capacity < 1.
        FileNotFoundError: `attach` to a segment that does not exist.
    """

    def __init__(self, memory: shared_memory.SharedMemory, slots: int, capacity: int,
                 owner: bool) -> None:
        self._memory, self.slots, self.capacity, self.owner = memory, slots, capacity, owner
        self._stride = slot_bytes(capacity)
        self._buffer = memory.buf

    @property
    def name(self) -> str:
        return self._memory.name

    @classmethod
    def create(cls, slots: int, capacity: int = DEFAULT_CAPACITY) -> 'FrameSlots':
        if slots < 1 or capacity < 1:
            raise ValueError(f'slots and capacity must be >= 1, got {slots}, {capacity}')
        name = f'{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(6)}'
        # a new segment reads as zeros (ftruncate): every slot at seq 0, count 0
        memory = shared_memory.SharedMemory(name=name, create=True,
                                            size=slots * slot_bytes(capacity))
        return cls(memory, slots, capacity, owner=True)

    @classmethod
    def attach(cls, name: str, slots: int, capacity: int) -> 'FrameSlots':
        if slots < 1 or capacity < 1:
            raise ValueError(f'slots and capacity must be >= 1, got {slots}, {capacity}')
        # Python < 3.13 registers an attached segment with the resource tracker too; a
        # 'spawn' child shares its parent's tracker, which keeps one entry per name, so the
        # owner's unlink still removes it
        return cls(shared_memory.SharedMemory(name=name), slots, capacity, owner=False)

    # -------------------------------------------------------------------- writer
    def write(self, slot: int, data, stamp: float, received: float, *, height: int = 0,
              width: int = 0, step: int = 0, encoding: str = '', compressed: bool = False,
              ) -> bool:
        """Write one message into `slot` (the only writer of that slot).

        Args:
            data: the message data (bytes-like: bytes, array.array('B'), memoryview).
            stamp: header stamp, s. received: receive time, s.
            height, width, step, encoding: a raw image's fields (pixels, pixels, bytes per
                row, e.g. 'rgb8'). compressed: True for a CompressedImage, whose format is
                `encoding`.

        Returns:
            True if the data was written, False if it is larger than `capacity` (then only
            the header is, with the size: the reader refuses the frame naming it).

        Raises:
            ValueError: `encoding` longer than TEXT_BYTES bytes of ascii.
        """
        view = memoryview(data).cast('B')
        text = encoding.encode('ascii', 'replace')
        if len(text) > TEXT_BYTES:
            raise ValueError(f'encoding / format {encoding[:40]!r}...: {len(text)} bytes, '
                             f'expected at most {TEXT_BYTES}')
        offset = slot * self._stride
        buffer = self._buffer
        header = offset + SEQ_BYTES
        seq = _load_seq(buffer, offset)
        count = HEADER.unpack_from(buffer, header)[0] + 1
        seq += 1 + seq % 2                  # (odd already: a writer died mid-write)
        _store_seq(buffer, offset, seq)                             # odd: being written
        _fence()
        fits = len(view) <= self.capacity
        HEADER.pack_into(buffer, header, count, float(stamp), float(received), len(view),
                         int(height), int(width), int(step), bool(compressed), len(text), text)
        struct.pack_into('<d', buffer, header + HEADER.size + 8 * (count % RECENT),
                         float(received))
        if fits:
            start = header + HEADER.size + _RECENT.size
            buffer[start:start + len(view)] = view
        _fence()
        _store_seq(buffer, offset, seq + 1)                         # even: consistent
        return fits

    # -------------------------------------------------------------------- reader
    def read(self, slot: int, since: int = 0, wait: float = READ_WAIT_S) -> SlotFrame | None:
        """The newest message of `slot` if it is newer than message number `since` (a
        `SlotFrame.count` seen before; 0: none seen), else None. A slot being written, or
        overwritten while copied, is read again until `wait` seconds have passed (the write
        ends within a copy's time), then None (a writer that died mid-write)."""
        give_up = time.perf_counter() + wait
        while True:
            frame = self._read_once(slot * self._stride, since)
            if frame is not _TORN:
                return frame
            if time.perf_counter() >= give_up:
                return None
            time.sleep(0)           # let the writer's CPU run

    def _read_once(self, offset: int, since: int):
        """One attempt of `read` at the slot at `offset`: a SlotFrame, None (nothing newer than
        `since`), or _TORN (being written, or overwritten while copied)."""
        buffer = self._buffer
        header = offset + SEQ_BYTES
        before = _load_seq(buffer, offset)
        if before % 2:
            return _TORN            # being written
        _fence()
        (count, stamp, received, length, height, width, step, compressed, text_length,
         text) = HEADER.unpack_from(buffer, header)
        if count <= since:
            _fence()
            return None if _load_seq(buffer, offset) == before else _TORN
        recent = _RECENT.unpack_from(buffer, header + HEADER.size)
        start = header + HEADER.size + _RECENT.size
        fits = length <= self.capacity
        data = bytes(buffer[start:start + length]) if fits else b''
        _fence()
        if _load_seq(buffer, offset) != before:
            return _TORN            # overwritten while copying
        text = text[:text_length].decode('ascii', 'replace')
        too_large = '' if fits else (
            f'a frame of {length} bytes does not fit the shared-memory slot of the camera '
            f'receiver process ({self.capacity} bytes): set camera_receiver: in_process, or '
            'lower the camera resolution')
        message = (CompressedFrame(text, data, too_large) if compressed
                   else RawFrame(height, width, text, step, data, too_large))
        earlier = range(max(since + 1, count - RECENT + 1), count)
        return SlotFrame(count, stamp, received, message,
                         tuple(recent[n % RECENT] for n in earlier))

    # -------------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Release this process's mapping (idempotent)."""
        if self._buffer is not None:
            self._buffer = None
            self._memory.close()

    def unlink(self) -> None:
        """Close and remove the segment (owner only; idempotent: a segment already gone is
        fine)."""
        self.close()
        if self.owner:
            try:
                self._memory.unlink()
            except FileNotFoundError:
                pass
