"""Every signal handler the package installs takes no lock and does no I/O (``handler_audit`` says why); the
orderly-shutdown handlers of ``oxygen_node`` / ``sim_node`` and the replayer's only record the request.  The trainer's
SIGINT handler is audited in ``test_train.py`` (it lives inside a training run)."""
from __future__ import annotations

import signal
import threading

import pytest

from conftest import require_ros
from handler_audit import blocking_calls

require_ros()


def test_the_audit_sees_the_locks_that_deadlocked():
    """The audit itself: an Event set in a handler (what ``oxygen_node`` did) and a print are reported."""
    ev = threading.Event()
    assert any("Event.set" in c for c in blocking_calls(lambda s, f: ev.set(), signal.SIGINT))
    assert any("print" in c for c in blocking_calls(lambda s, f: print("x", end=""), signal.SIGINT))
    assert blocking_calls(lambda s, f: None, signal.SIGINT) == []


def test_node_shutdown_request_only_records_the_signals():
    from oxygen_ros.ros.node import _ShutdownRequest
    req = _ShutdownRequest()
    assert not req.requested
    assert blocking_calls(req, signal.SIGINT) == []                  # the first asks for the shutdown
    t_first = req.t_first
    assert req.requested and t_first > 0
    assert blocking_calls(req, signal.SIGTERM) == []                 # a second one mid-shutdown is only noted
    assert req.requested and req.t_first == t_first and req.signals == [signal.SIGINT, signal.SIGTERM]


def test_replay_stop_request_takes_no_lock_and_stops_the_playback(synthetic_bag):
    import rclpy
    from oxygen_ros.tools.bags.replay import BagReplayer
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    node = rclpy.create_node("handler_audit_replay", context=ctx)
    try:
        rep = BagReplayer(node, synthetic_bag, loop=True, namespace="/handler_audit").start()
        assert rep.running
        assert blocking_calls(lambda s, f: rep.request_stop(), signal.SIGINT) == []
        assert rep.stop_requested
        rep.join(5.0)                       # the playback thread sees the request within its 0.05 s pacing wait
        assert not rep.running
    finally:
        node.destroy_node()
        ctx.try_shutdown()


def test_cli_sigterm_handler_raises_without_locking():
    """SIGTERM to an ``oxygen`` tool raises SystemExit(143) in the main thread (the KeyboardInterrupt model) and
    ignores further SIGTERMs; it takes no lock on the way."""
    from oxygen_ros.tools.cli import _stop_on_sigterm
    old = signal.getsignal(signal.SIGTERM)
    try:
        assert blocking_calls(_stop_on_sigterm, signal.SIGTERM, raises=SystemExit) == []
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        with pytest.raises(SystemExit) as exc:
            _stop_on_sigterm(signal.SIGTERM, None)
        assert exc.value.code == 143
    finally:
        signal.signal(signal.SIGTERM, old)
