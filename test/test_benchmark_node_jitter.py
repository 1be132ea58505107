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


def test_the_workers_stall_accounts_are_summarized_over_the_stalls():
    chunks = [_chunk(0.3, '0.400'), _chunk(3.1, '2.800'), _chunk(1.5, '1.300')]
    chunks[1][ChunkInfo.STALL_ACCOUNT] = ('on_cpu_ms=0.100 runqueue_ms=0.000 csw_voluntary=1 '
                                          'csw_involuntary=0 faults_minor=0 faults_major=0')
    chunks[2][ChunkInfo.STALL_ACCOUNT] = ('on_cpu_ms=1.200 runqueue_ms=0.050 csw_voluntary=0 '
                                          'csw_involuntary=1 faults_minor=4 faults_major=0')
    accounts = bench.publish_delay(chunks)['stall_accounts']
    assert accounts['on_cpu_ms']['n'] == 2 and accounts['on_cpu_ms']['max'] == 1.2
    assert accounts['faults_minor']['max'] == 4 and accounts['csw_voluntary']['p50'] == 0.5
    assert bench.publish_delay(chunks[:1])['stall_accounts'] == {}
