"""camera_receiver 'auto' / 'in_process' / 'subprocess': where the cameras are received
(`ros.camera_receiver.choose_receiver`, no rclpy)."""
from __future__ import annotations

from molmobot_policy.ros.camera_receiver import SHM_HEADROOM, choose_receiver
from molmobot_policy.ros.frame_slots import DEFAULT_CAPACITY, slot_bytes

MIB = 2 ** 20
ROOM = 8 * slot_bytes(DEFAULT_CAPACITY) + SHM_HEADROOM      # 8 cameras, every slot full


def test_auto_receives_in_a_child_process_on_the_system_clock_with_room_in_dev_shm():
    choice = choose_receiver('auto', False, 8, ROOM)
    assert choice.mode == 'subprocess' and not choice.warning
    assert choice.reason == (f'auto: the system clock, {ROOM / MIB:.0f} MiB free in /dev/shm '
                             f'for {ROOM / MIB:.0f} MiB (8 cameras x 8 MiB + 32 MiB for DDS)')


def test_auto_receives_in_process_with_use_sim_time_and_says_why():
    choice = choose_receiver('auto', True, 8, 24 * 1024 * MIB)
    assert choice.mode == 'in_process' and 'use_sim_time' in choice.reason
    assert not choice.warning


def test_auto_receives_in_process_where_dev_shm_cannot_hold_every_slot_full():
    """Docker's default /dev/shm (64 MiB) holds 8 cameras x 8 MiB but not Fast DDS beside
    them: in process, naming what is free and what was wanted."""
    choice = choose_receiver('auto', False, 8, ROOM - 1)
    assert choice.mode == 'in_process' and not choice.warning
    assert f'{(ROOM - 1) / MIB:.0f} MiB free in /dev/shm for {ROOM / MIB:.0f} MiB' \
        in choice.reason, choice.reason
    assert choose_receiver('auto', False, 8, 64 * MIB).mode == 'in_process'
    assert choose_receiver('auto', False, 2, 64 * MIB).mode == 'subprocess'
    assert 'no /dev/shm' in choose_receiver('auto', False, 8, None).reason


def test_an_explicit_setting_is_kept_and_a_short_dev_shm_is_a_warning():
    assert choose_receiver('in_process', False, 8, ROOM) == ('in_process', 'set', False)
    assert choose_receiver('subprocess', False, 8, ROOM) == ('subprocess', 'set', False)
    short = choose_receiver('subprocess', False, 8, 10 * MIB)
    assert short.mode == 'subprocess' and short.warning and 'dies' in short.reason
