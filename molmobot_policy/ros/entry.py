"""The policy node's process entry, standard library only so that it runs before the slow
imports (rclpy, the node, torch and the model: seconds): the `policy_node` console script
(setup.py, what `ros2 launch` starts) and `python -m molmobot_policy.ros.node`.

`main` installs the stop signals (`StopSignals`: SIGINT / SIGTERM are a stop request, not a
KeyboardInterrupt) before it imports the node's process (`ros.main`) and runs it. A stop
requested during those imports ends the process right after them, exit status 0 and one line
saying so, as one during configure does; a second Ctrl-C interrupts at once (exit 130).
"""
from __future__ import annotations

import signal
import sys
import threading
import time

NODE_NAME = 'molmobot_policy'
EXIT_OK, EXIT_FAILURE, EXIT_INTERRUPTED = 0, 1, 130
INTERRUPTED_STARTING = 'interrupted while starting (configure / activate)'


def print_log(name: str, severity: str, message: str) -> None:
    """A log line in the ROS console format, printed to stderr: for when no ROS logger can
    take it (before rclpy starts, or after Ctrl-C shut the context and /rosout down).

    Never raises: a stderr that cannot be written (the pty of a `ros2 launch` that exited,
    emulate_tty: OSError EIO; a closed stream: ValueError) loses the line, and the caller,
    often on its way to stopping the node, goes on."""
    try:
        print(f'[{severity}] [{time.time():.9f}] [{name}]: {message}', file=sys.stderr,
              flush=True)
    except (OSError, ValueError):
        pass


class StopSignals:
    """Python's handler for SIGINT and SIGTERM from the process entry on: the first sets
    `requested` and raises nothing (the main thread stops at its next check, then shuts the
    context down itself); a later SIGINT raises KeyboardInterrupt, as Python's default does,
    except one within REPEAT_S of the first: that is the same stop request delivered twice (a
    supervisor's SIGINT to the process group, then `ros2 launch` forwarding its own). A later
    SIGTERM raises nothing (`ros2 launch` escalates with SIGKILL).

    Installed from the main thread only (Python runs signal handlers there), over whatever
    was set before, SIG_IGN included: a node started as a shell's background job (SIGINT
    ignored) still stops when `ros2 launch` or a supervisor sends it SIGINT.
    """

    REPEAT_S = 1.0
    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, clock=time.monotonic) -> None:
        self.requested = threading.Event()
        # called once, on a thread of its own, at the first request (e.g. the node's
        # `request_stop`: the worker then sends nothing more); on the main thread it could
        # wait on a lock the interrupted code holds
        self.on_request = None
        self.count = 0          # SIGINTs after the stop request, the same one repeated aside
        self._previous: dict[int, object] = {}
        self._clock, self._first = clock, None
        self.name = NODE_NAME   # the logger name of its line: the node's, once it exists

    def __call__(self, signum, frame) -> None:
        if self.requested.is_set():
            if self._clock() - self._first < self.REPEAT_S or signum != signal.SIGINT:
                return      # the same request again, or SIGTERM again
            self.count += 1
            print_log(self.name, 'WARN', 'SIGINT again: interrupting at once (exit status '
                                         f'{EXIT_INTERRUPTED})')
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        again = (f' (Ctrl-C again, {self.REPEAT_S:.0f} s or more from now, to interrupt at '
                 'once)' if signum == signal.SIGINT else '')
        self.request(f'{name}: stopping after the current step{again}')

    def request(self, line: str | None = None) -> None:
        """The stop request itself (a signal's, or `ParentWatch`'s from its thread): sets
        `requested`, runs `on_request` on a thread of its own and prints `line` (INFO)."""
        if self.requested.is_set():
            return
        self._first = self._clock()
        self.requested.set()
        if self.on_request is not None:
            threading.Thread(target=self.on_request, name='stop-request', daemon=True).start()
        if line:
            print_log(self.name, 'INFO', line)

    @property
    def forced(self) -> bool:
        """True after a second SIGINT."""
        return self.count > 0

    def install(self) -> 'StopSignals':
        """Before rclpy.init (which is then told to install no handler). Returns self."""
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self)
        return self

    def uninstall(self) -> None:
        """Restore the handlers found at `install`."""
        while self._previous:
            signum, previous = self._previous.popitem()
            signal.signal(signum, previous)


def main(args=None) -> int:
    """Console entry point: `ros.main.main` with the stop signals installed before its
    imports. Returns the exit status."""
    stop = StopSignals().install()
    try:
        from molmobot_policy.ros import main as process     # the slow imports
    except KeyboardInterrupt:       # a second Ctrl-C during them
        stop.uninstall()
        return EXIT_INTERRUPTED
    return process.main(args, stop=stop)
