"""The policy node's process, run by its entry (`ros.entry`: the `policy_node` console script,
setup.py, and `python -m molmobot_policy.ros.node`, which install the stop signals before
this module's imports).

    python -m molmobot_policy.ros.node --ros-args --params-file config/policy_tiny.yaml

Runs `PolicyNode` on a `QuietExecutor` (rclpy's SingleThreadedExecutor whose callbacks wait
out the worker's publish window); with `autostart` (default) it configures
and activates the node itself, for users without lifecycle tooling.

Signals: SIGINT (Ctrl-C) and SIGTERM are a stop request (`StopSignals`, installed instead of
rclpy's handlers): the main thread stops at its next check (the spin loop within
SPIN_TIMEOUT_S, configure between its steps and warm-up buckets), stops the worker, destroys
the node and only then shuts the ROS context down, so no thread logs to /rosout on a context
already shut (rclpy's own handler shuts it from a thread of its own while the node still runs,
which no check before a log line can exclude: 'Failed to publish log message to rosout').
Python raises no KeyboardInterrupt for that first Ctrl-C, so no step is cut in the middle. A
second Ctrl-C (more than StopSignals.REPEAT_S after the first) interrupts at once
(KeyboardInterrupt, e.g. during a long checkpoint load or compile) and the process exits 130,
the shell's status for SIGINT.

Parent exit (`stop_with_parent`, default true): `ros2 launch` answers SIGTERM (what systemd
and `docker stop` send) by exiting without stopping the processes it started, which would
leave this node commanding the arm unsupervised. `ParentWatch` checks every PARENT_CHECK_S
whether the process that started the node is gone (the node was re-parented) and then stops
it as Ctrl-C does. Not when the process was started with SIGHUP ignored (`nohup`): that
asks for a process that outlives its parent's session (a script's `nohup ... &`), and the
node says so in its log (NOHUP_NOTE).

Exit status: 0 after a clean stop, 1 when the node cannot start (bad environment, parameter
or parameter file, configure failed), 130 after a second Ctrl-C.

`main` lowers the interpreter's thread switch interval (SWITCH_INTERVAL_S) so that a
subscription callback thread holding the GIL delays the worker's wake-up by at most that.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager

import rclpy
from rclpy.executors import (ConditionReachedException, ExternalShutdownException,
                             ShutdownException, SingleThreadedExecutor, TimeoutException)
from rclpy.signals import SignalHandlerOptions

from molmobot_policy.ros.entry import (EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK,
                                       INTERRUPTED_STARTING, NODE_NAME, StopSignals,
                                       print_log)
from molmobot_policy.ros.node import PolicyNode
from molmobot_policy.timing.stats import freeze_for_exit

SWITCH_INTERVAL_S = 0.0005  # sys.setswitchinterval (CPython default 0.005 s): the longest a
                            # GIL-holding callback thread delays the worker's wake-up
PARENT_CHECK_S = 0.1        # ParentWatch's polling period
SPIN_TIMEOUT_S = 0.1        # the spin loop's longest wait between stop-request checks: a
                            # Python signal handler runs only once rcl's wait returns


# what wait_for_ready_callbacks raises for "no callback to run"
_NOTHING_READY = (ShutdownException, TimeoutException, ConditionReachedException)


class QuietExecutor(SingleThreadedExecutor):
    """rclpy's SingleThreadedExecutor whose callbacks wait out the worker's publish window.

    Each ready callback (a joint state, a timer, the diagnostics, a service) runs after
    `quiet.wait_out()`: while the worker polls the clock for its deadline and sends a chunk
    (`timing.QuietWindow`), the executor thread waits without the GIL, so the publish does not
    wait for a callback's Python to give the GIL back (at most `timing.loop.QUIET_MAX_S` per
    window; messages meanwhile queue in their subscriptions, their QoS depth >= 2). Same
    semantics as `SingleThreadedExecutor.spin_once` otherwise (public API only).
    """

    def __init__(self, quiet, **kwargs) -> None:
        super().__init__(**kwargs)
        self._quiet = quiet

    def spin_once(self, timeout_sec=None) -> None:
        try:
            handler, _, _ = self.wait_for_ready_callbacks(timeout_sec)
        except _NOTHING_READY:
            return
        self._quiet.wait_out()
        handler()
        exception = handler.exception()
        if exception is not None:
            raise exception
        handler.result()


def orphan_note(parent: int, environ) -> tuple[str, object]:
    """(line, severity) for a node whose parent was pid `parent` <= 1 at start: nothing to
    watch. INFO under systemd (INVOCATION_ID set) or as a container's first process (parent 0);
    else WARN: the process that started it has most likely exited already (a shell's
    `policy_node &` that ended within the interpreter's start), so it runs unsupervised."""
    from rclpy.logging import LoggingSeverity
    if parent <= 0 or environ.get('INVOCATION_ID'):
        return ('stop_with_parent: started by a service manager or as a container\'s first '
                'process: no parent to watch', LoggingSeverity.INFO)
    return ('stop_with_parent: this node was orphaned before it started (its parent is init, '
            'pid 1: the process that started it, e.g. a shell running `policy_node &`, has '
            'exited): nothing stops it with that process; stop it with SIGINT or SIGTERM',
            LoggingSeverity.WARN)


NOHUP_NOTE = ('stop_with_parent: not watching the process that started this node: it was '
              'started with SIGHUP ignored (nohup), which asks to outlive it; stop the node '
              'with SIGINT (Ctrl-C) or SIGTERM')


class ParentWatch:
    """Sends this process SIGINT (the Ctrl-C path: a graceful stop) once the process that
    started it has exited, i.e. `os.getppid()` differs from what it read at `start`.

    Args:
        name: the node's logger name for the log line (namespace included, as the node's
            own lines). period: seconds between checks (> 0).
        getppid: injected for tests (os.getppid). kill: () -> None, the stop (`main` passes
            `StopSignals.request`; default os.kill(os.getpid(), SIGINT)).
    """

    def __init__(self, name: str, period: float = PARENT_CHECK_S, getppid=os.getppid,
                 kill=None) -> None:
        self._name, self._period, self._getppid = name, period, getppid
        self._kill = kill or (lambda: os.kill(os.getpid(), signal.SIGINT))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.parent: int | None = None
        self.fired = False

    def start(self, parent: int | None = None) -> 'ParentWatch':
        """Watch `parent` (default: the parent now; pass the one read at process start)."""
        self.parent = self._getppid() if parent is None else parent
        self._thread = threading.Thread(target=self._run, name='parent-watch', daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        """Checks until `stop`. An error in the check stops the node too: a dead watch
        would leave it commanding the arm unsupervised."""
        try:
            while not self._stop.wait(self._period):
                if self._getppid() != self.parent:
                    self._fire(f'the process that started this node (pid {self.parent}) has '
                               'exited (e.g. `ros2 launch` stopped with SIGTERM, which leaves '
                               'its children running)')
                    return
        except Exception as error:  # noqa: BLE001 - see above
            if not self.fired:
                self._fire(f'the parent watch failed ({error!r})')
            raise

    def _fire(self, why: str) -> None:
        """The log line, then the stop, which runs whatever the line does: the console may be
        unwritable by then (the pty of a `ros2 launch` that exited, emulate_tty: OSError EIO).
        The line goes through the ROS logger while the context is up (before the stop shuts it
        down: after, /rosout refuses it), so that it also lands in the node's log file under
        ~/.ros/log, where an operator looks once the launch and its console are gone; the
        plain console line only where that logger fails."""
        self.fired = True
        message = f'{why}: stopping; stop_with_parent: false keeps running'
        try:
            rclpy.logging.get_logger(self._name).error(message)
        except Exception:  # noqa: BLE001 - the line is what is lost, never the stop
            print_log(self._name, 'ERROR', message)       # never raises
        finally:
            self._kill()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)


_SEVERITY = {logging.CRITICAL: 'FATAL', logging.ERROR: 'ERROR', logging.WARNING: 'WARN',
             logging.INFO: 'INFO'}


class RosLogHandler(logging.Handler):
    """Python `logging` records (the package's own: the engine's and fp8's, which hold no ROS
    logger) passed to a ROS logger, so that they reach the console and /rosout formatted and
    filtered like the node's lines; without it a warning printed as a bare line and an info
    line (e.g. which fp8 mode the start-up probe chose) not at all. Once `context` is shut
    down (Ctrl-C) the records are printed in the same format instead."""

    def __init__(self, ros_logger, context=None) -> None:
        super().__init__(logging.INFO)
        self._ros_logger = ros_logger
        self._context = context

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            level = record.levelno
            if self._context is not None and not self._context.ok():
                print_log(self._ros_logger.name, _SEVERITY.get(level, 'DEBUG'), message)
            elif level >= logging.CRITICAL:
                self._ros_logger.fatal(message)
            elif level >= logging.ERROR:
                self._ros_logger.error(message)
            elif level >= logging.WARNING:
                self._ros_logger.warning(message)
            elif level >= logging.INFO:
                self._ros_logger.info(message)
            else:
                self._ros_logger.debug(message)
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


@contextmanager
def package_logs_to(node):
    """Within: the `molmobot_policy` Python loggers print through `node`'s ROS logger only."""
    package_log = logging.getLogger('molmobot_policy')
    forward = RosLogHandler(node.get_logger(), node.context)
    package_log.addHandler(forward)
    package_log.setLevel(logging.INFO)
    package_log.propagate = False       # printed once, by the ROS logger
    try:
        yield
    finally:
        package_log.removeHandler(forward)
        package_log.propagate = True


def ros_domain_id_problem(environ) -> str | None:
    """Why the environment's ROS_DOMAIN_ID cannot work, or None (unset is fine).

    Fast DDS derives its UDP ports from the domain id (port = 7400 + 250 * id + offset), so ids
    above 232 give ports above 65535 and DDS fails to start with a transport error only."""
    value = environ.get('ROS_DOMAIN_ID', '').strip()
    if not value:
        return None
    if not value.isdigit() or int(value) > 232:
        return f'ROS_DOMAIN_ID must be an integer from 0 to 232, got {value!r}'
    return None


USAGE = """usage: policy_node [--help] [--ros-args --params-file FILE | -p NAME:=VALUE ...]

The MolmoBot policy node (a ROS 2 lifecycle node, name molmobot_policy): camera topics and
/joint_states in, trajectory_msgs/JointTrajectory on ~/joint_trajectory out.
  policy_node --ros-args --params-file config/policy_droid.yaml     (a GPU, a checkpoint)
  policy_node --ros-args --params-file config/policy_tiny.yaml      (random weights, CPU)
Every parameter, its type, default and range: docs/PARAMETERS.md; a robot: docs/ROBOT.md.
Exit status: 0 after a clean stop, 1 when the node cannot start, 130 after a second Ctrl-C."""


def wants_help(argv) -> bool:
    """-h / --help before any --ros-args (after it, arguments are ROS's)."""
    own = list(argv[1:])
    if '--ros-args' in own:
        own = own[:own.index('--ros-args')]
    return '-h' in own or '--help' in own


def main(args=None, stop: StopSignals | None = None) -> int:
    """Run the node until Ctrl-C (`ros.entry.main`, the console entry point, calls it with
    `stop` installed before this module's imports; else it installs its own). Returns the
    exit status (see the module docstring); prints USAGE for -h / --help. Once the node has
    started, the process is meant to exit when this returns: the garbage collector is left
    stopped and the heap frozen (`timing.stats.freeze_for_exit`)."""
    stop = stop if stop is not None else StopSignals().install()
    if stop.requested.is_set():     # during the imports
        print_log(NODE_NAME, 'INFO', INTERRUPTED_STARTING)
        stop.uninstall()
        return EXIT_OK
    if wants_help(sys.argv if args is None else args):
        stop.uninstall()
        print(USAGE)
        return EXIT_OK
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    from molmobot_policy.ros import START_PARENT as parent   # read before the slow imports
    nohup = signal.getsignal(signal.SIGHUP) is signal.SIG_IGN     # as nohup starts a process
    problem = ros_domain_id_problem(os.environ)
    if problem:
        stop.uninstall()
        print_log(NODE_NAME, 'FATAL', problem)
        return EXIT_FAILURE
    try:    # no rclpy handler: it would shut the context down under the running node
        rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    except Exception as error:  # noqa: BLE001 - rclpy's RCLError, e.g. a params file that
        stop.uninstall()        # is not valid YAML
        print_log(NODE_NAME, 'FATAL', f'ROS 2 could not start: {error}'.rstrip())
        return EXIT_FAILURE
    try:
        try:    # the node checks the argument's parameter files at configure
            node = PolicyNode(argv=list(sys.argv if args is None else args),
                              stop_requested=stop.requested)
            stop.on_request = node.request_stop
            stop.name = node.get_logger().name      # with its namespace
        except ValueError as error:         # a parameter rclpy refused (ParameterError)
            print_log(NODE_NAME, 'FATAL', str(error))
            return EXIT_FAILURE
        watch = None
        if node.get_parameter('stop_with_parent').value:
            if nohup:
                node.get_logger().warning(NOHUP_NOTE)     # outlives its parent: not OK
            elif parent <= 1:
                node.get_logger().log(*orphan_note(parent, os.environ))
            else:   # a parent that exited during start-up is seen at the first check
                watch = ParentWatch(node.get_logger().name, kill=stop.request).start(parent)
        try:
            with package_logs_to(node):
                return _serve(node, stop)
        finally:
            if watch is not None:
                watch.stop()
    except KeyboardInterrupt:       # a second Ctrl-C while the node shuts down
        return EXIT_INTERRUPTED
    finally:
        rclpy.try_shutdown()     # after the node (and its worker) is gone: nothing logs late
        stop.uninstall()
        freeze_for_exit()       # the process exits next: no collections over the heap


def _say(node: PolicyNode, message: str) -> None:
    """An INFO line through the node's logger, or printed once the context is shut down
    (/rosout cannot take it then)."""
    if node.context.ok():
        node.get_logger().info(message)
    else:
        print_log(node.get_logger().name, 'INFO', message)


def _serve(node: PolicyNode, stop: StopSignals) -> int:
    """Autostarts, spins until a stop request or the context's shutdown; destroys the node
    (which stops the worker) in every case."""
    starting = False        # inside autostart's configure + activate
    try:
        # One thread for every callback: they only store messages (the worker thread runs
        # inference), and they wait out the worker's publish window (QuietExecutor).
        # rclpy's MultiThreadedExecutor under 240 camera frames/s creates task and future
        # objects per callback (a garbage collection every few ms) and holds the GIL the
        # worker needs between CUDA calls: inference p99 and publish jitter grow several-fold.
        executor = QuietExecutor(node.quiet_window)
        executor.add_node(node)
        if node.get_parameter('autostart').value:
            starting = True
            started = node.autostart()
            starting = False
            interrupted = stop.requested.is_set() or not node.context.ok()
            if not started and not interrupted:
                node.get_logger().fatal('autostart failed (see the error above); exiting')
                return EXIT_FAILURE
            if not started:     # SIGINT / SIGTERM while starting
                _say(node, INTERRUPTED_STARTING)
                return EXIT_OK
        else:
            name = node.get_fully_qualified_name()
            node.get_logger().info(
                f'autostart is off: waiting unconfigured for lifecycle transitions on '
                f'{name}/change_state (e.g. `ros2 lifecycle set {name} configure`, then '
                'activate; without the ros2 CLI: docs/ROBOT.md "Lifecycle")')
        while node.context.ok() and not stop.requested.is_set():
            executor.spin_once(timeout_sec=SPIN_TIMEOUT_S)
    except (KeyboardInterrupt, ExternalShutdownException) as interrupt:
        if starting:
            _say(node, INTERRUPTED_STARTING)
        if isinstance(interrupt, KeyboardInterrupt) and stop.forced:
            return EXIT_INTERRUPTED
    except Exception:   # noqa: BLE001
        if rclpy.ok():  # a real error; after Ctrl-C, calls on the shut-down context fail
            raise
    finally:
        chunks = node.chunks_published_total
        _say(node, f"shutting down after {chunks} chunk{'' if chunks == 1 else 's'}")
        node.destroy_node(exiting=True)
    return EXIT_OK


if __name__ == '__main__':
    from molmobot_policy.ros.entry import main as entry_main
    raise SystemExit(entry_main())
