"""What a signal handler does that can block or fail where Python runs it.

Python runs a handler in the main thread between two bytecodes, so it can run while the main thread holds one of
its own locks: inside an Event's ``wait``/``set`` (a ``Condition`` on a plain, non-reentrant lock), inside a
``print`` (stdout's buffer lock), inside ``logging``.  A handler that then takes the same lock deadlocks the
process for good, or raises "reentrant call" out of whatever the main thread was doing.  A handler must only set
attributes, append to a list, read the clock, or raise (the interpreter's own KeyboardInterrupt / SystemExit
model)."""
from __future__ import annotations

import sys
import threading

BLOCKING_C_CALLS = {"acquire", "acquire_lock", "wait", "join", "print", "write", "flush", "sleep"}


def blocking_calls(handler, signum: int, raises: type[BaseException] | None = None) -> list[str]:
    """Calls ``handler(signum, None)`` directly, as the interpreter would, and returns each call it made that takes
    a lock or does I/O: C calls by name (``acquire``, ``print``, ``write`` ...) and any Python function of the
    ``threading`` module (``Event.set``, ``Condition.notify``).  ``raises``: the exception the handler must raise
    (caught here); any other propagates."""
    found: list[str] = []

    def profile(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", "") in BLOCKING_C_CALLS:
            found.append(f"{frame.f_code.co_name} -> {getattr(arg, '__qualname__', arg.__name__)}")
        elif event == "call" and frame.f_code.co_filename == threading.__file__:
            found.append(f"threading.{frame.f_code.co_qualname}")

    raised = None
    sys.setprofile(profile)
    try:
        handler(signum, None)
    except BaseException as exc:  # noqa: BLE001 - checked against `raises` below
        raised = exc
    finally:
        sys.setprofile(None)
    if raises is None and raised is not None:
        raise raised
    if raises is not None and not isinstance(raised, raises):
        raise AssertionError(f"the handler raised {raised!r}, not {raises.__name__}")
    return found
