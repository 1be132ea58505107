"""benchmarks/benchmark_node_jitter.py's reading of the node's delay clues: the late chunks'
parts, and where the other threads were after a deadline-poll stall, threads always found
in one place reported as parked rather than crowding out the one that moves."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'benchmarks'))

import benchmark_node_jitter as bench  # noqa: E402
from molmobot_policy.ros.messages import ChunkInfo  # noqa: E402


def _chunk(jitter_ms: float, stall_ms: str = '', threads: str = '') -> dict:
    chunk = {'publish_jitter_ms': f'{jitter_ms:.3f}', ChunkInfo.WAKE_LATE_MS: '0.250',
             ChunkInfo.RUNQUEUE_WAIT_MS: '0.000', ChunkInfo.PUBLISH_CALL_MS: '0.200',
             ChunkInfo.TAIL_STALL_MS: stall_ms}
    if threads:
        chunk[ChunkInfo.STALLED_THREADS] = threads
    return chunk


def test_stalls_name_the_moving_thread_and_list_the_parked_ones():
    parked = 'decode_0: _worker thread.py:89 < run threading.py:1010'
    chunks = [_chunk(0.3, '0.400'),
              _chunk(3.5, '3.300', f'{parked}; MainThread: _quantile numpy/x.py:1'),
              _chunk(2.1, '1.900', f'{parked}; MainThread: publish rclpy/publisher.py:72'),
              _chunk(1.6, '1.400', f'{parked}; MainThread: _quantile numpy/x.py:1')]
    delay = bench.publish_delay(chunks)
    assert delay['late_chunks'] == 3
    assert delay['parked_threads'] == ['decode_0']
    assert delay['stalled_threads'] == [('MainThread: _quantile numpy/x.py:1', 2),
                                        ('MainThread: publish rclpy/publisher.py:72', 1)]
    assert delay['late'][ChunkInfo.TAIL_STALL_MS]['max'] == 3.3
    assert delay['all'][ChunkInfo.TAIL_STALL_MS]['n'] == 4
