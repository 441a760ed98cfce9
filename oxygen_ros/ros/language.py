"""Language outputs: from the engine's per-token and per-request callbacks to what the node publishes.

This file owns a request's stream after the engine: ``RequestTracker`` forwards each generated token at once
(``TokenOut``), ends every request with exactly one ``is_final`` token whatever the order in which the engine's
final ``TokenEvent`` and its ``RequestResult`` arrive, and turns a finished request into its product: for every
conversation request, whatever its outcome, one ``ResponseOut`` (request id, prompt, the text the model read, answer,
finish reason, token count, time to first token and total time from acceptance), and for a memory request a memory
entry (``MemoryOut``, kept by the ``MemoryLog`` first so that its ``entry_id`` is the row id, or 0 while the database
fails; published again with its id once stored).  Requests that never produced a token (rejected, dropped,
cancelled early, failed) end with an empty final marker (``token_id`` -1) carrying the reason, and are counted;
``end()`` does the same for a request that ended before the engine saw it (dropped from the node's queue, refused by
``engine.submit``).  No rclpy: the node (or ``oxygen bag-eval``) supplies an ``Outputs`` sink that turns these records
into messages, and a clock in ns that stamps them.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

from oxygen_ros.engine.requests import RequestResult

from .diagnostics import Reporter
from .memory_log import MemoryLog
from .memory_store import StoredEntry

__all__ = ["TokenOut", "ResponseOut", "MemoryOut", "ChunkOut", "Outputs", "RequestTracker", "memory_out",
           "FINISHED_OK"]

FINISHED_OK = ("eos", "length")


@dataclass(frozen=True)
class TokenOut:
    request_id: int
    kind: str
    frame_index: int
    index: int
    token_id: int                # -1 for an empty final marker
    text: str
    is_final: bool
    finish_reason: str           # "" except on the final token
    stamp_ns: int


@dataclass(frozen=True)
class ResponseOut:
    """The end of one conversation request (completed or not)."""
    request_id: int
    prompt: str
    text: str                    # the streamed pieces joined (partial when cancelled, "" when never run)
    finish_reason: str
    num_tokens: int
    frame_index: int
    stamp_ns: int
    detail: str = ""             # why it was dropped / rejected / failed
    model_prompt: str = ""       # what the model read (memory context included)
    ttft_s: float = -1.0         # acceptance -> first token (steady clock); -1 = no token
    total_s: float = 0.0         # acceptance -> end

    @property
    def completed(self) -> bool:
        return self.finish_reason in FINISHED_OK


@dataclass(frozen=True)
class MemoryOut:
    entry_id: int                # SQLite row id (or a counter when no database is configured); 0 = not stored
    frame_index: int
    text: str
    source_prompt: str
    request_id: int
    num_tokens: int
    stamp_ns: int                # capture time of the described frame
    frame_id: str


def memory_out(e: StoredEntry) -> MemoryOut:
    return MemoryOut(e.entry_id, e.frame_index, e.text, e.source_prompt, e.request_id, e.num_tokens, e.stamp_ns,
                     e.frame_id)


@dataclass(frozen=True)
class ChunkOut:
    """A new action chunk (validated, absolute, clipped to the limits) as it went into the control buffer, and the
    buffer's view of it at arrival (rows from the current one on, after blending / the RTC switch / the step limit;
    None when no row is left): what the JointTrajectory output publishes."""
    frame_index: int
    chunk_id: int
    actions: object              # np.ndarray [H, A] float32
    capture_ns: int
    ready_ns: int
    latency_ms: float
    frame_id: str
    view: object = None          # control.ChunkView | None


class Outputs(Protocol):
    def token(self, t: TokenOut) -> None: ...
    def response(self, r: ResponseOut) -> None: ...
    def memory(self, m: MemoryOut) -> None: ...
    def chunk(self, c: ChunkOut) -> None: ...


@dataclass
class _Stream:
    kind: str
    prompt: str = ""
    t_accept: float = field(default_factory=time.monotonic)
    t_first: float = 0.0
    texts: list = field(default_factory=list)
    n: int = 0                   # tokens forwarded
    final: object = None         # the engine's final TokenEvent, once seen
    result: object = None        # the engine's RequestResult, once seen
    frame_index: int = -1


class RequestTracker:
    """Thread-safe; ``on_token`` / ``on_finished`` are the engine callbacks (inference thread)."""

    def __init__(self, outputs: Outputs, report: Reporter, clock_ns: Callable[[], int], *,
                 memory: Optional[MemoryLog] = None, frame_info: Callable[[int], tuple] = lambda fi: (0, ""),
                 default_memory_prompt: str = ""):
        self.out, self.report, self.clock_ns = outputs, report, clock_ns
        self.memory = memory if memory is not None else MemoryLog("", report)
        self.memory.on_stored = self._stored_later   # an entry published with id 0 is published again when stored
        self.frame_info = frame_info                 # frame_index -> (capture_ns, frame_id)
        self.default_memory_prompt = default_memory_prompt
        self._lock = threading.Lock()
        self._streams: dict[int, _Stream] = {}

    def register(self, request_id: int, kind: str, prompt: str = "") -> None:
        """A request was accepted (its latencies count from now)."""
        with self._lock:
            self._streams.setdefault(request_id, _Stream(kind, prompt))

    def end(self, request_id: int, kind: str, prompt: str, reason: str, detail: str = "") -> None:
        """A request that ended before the engine saw it (dropped from the node's queue, refused by submit)."""
        self.register(request_id, kind, prompt)
        self.on_finished(RequestResult(request_id, kind, -1, prompt, "", [], time.time(), reason, detail))

    def active(self) -> int:
        with self._lock:
            return len(self._streams)

    def clear(self) -> None:
        with self._lock:
            self._streams.clear()

    def _stream(self, rid: int, kind: str) -> _Stream:
        return self._streams.setdefault(rid, _Stream(kind))

    # ---------------------------------------------------------------------------------------------- engine callbacks
    def on_token(self, ev) -> None:
        with self._lock:
            s = self._stream(ev.request_id, ev.kind)
            s.frame_index = ev.frame_index
            if not s.t_first:
                s.t_first = time.monotonic()
            if ev.is_final:
                s.final = ev
                ready = s.result is not None
            else:
                s.texts.append(ev.text)
                s.n = ev.index + 1
                ready = False
        if not ev.is_final:
            self.out.token(TokenOut(ev.request_id, ev.kind, ev.frame_index, ev.index, ev.token_id, ev.text, False, "",
                                    self.clock_ns()))
        elif ready:
            self._finalize(ev.request_id)

    def on_finished(self, res) -> None:
        with self._lock:
            s = self._stream(res.request_id, res.kind)
            s.result = res
            ready = s.final is not None or res.finish_reason not in FINISHED_OK
        if res.finish_reason in ("rejected", "dropped", "error", "cancelled"):
            key = {"rejected": "request_rejected", "dropped": "prompt_dropped", "error": "request_error",
                   "cancelled": "request_cancelled"}
            detail = getattr(res, "detail", "") or ""
            self.report.event(key[res.finish_reason],
                              f"{res.kind} request {res.request_id} {res.finish_reason}: {detail}")
            if res.finish_reason == "rejected" and ("kv" in detail.lower() or "too_large" in detail.lower()):
                self.report.count("kv_full")
        if ready:
            self._finalize(res.request_id)

    def _finalize(self, rid: int) -> None:
        with self._lock:
            s = self._streams.pop(rid, None)
        if s is None:
            return
        res, ev = s.result, s.final
        reason = res.finish_reason if res is not None else "eos"
        kind = res.kind if res is not None else s.kind
        frame_index = s.frame_index if s.frame_index >= 0 else getattr(res, "frame_index", 0)
        now = self.clock_ns()
        if ev is not None:
            s.texts.append(ev.text)
            self.out.token(TokenOut(rid, kind, frame_index, ev.index, ev.token_id, ev.text, True, reason, now))
        else:   # never produced a final token (rejected / dropped / error): an empty final marker
            self.out.token(TokenOut(rid, kind, frame_index, s.n, -1, "", True, reason, now))
        text = "".join(s.texts)
        n_tokens = len(getattr(res, "token_ids", []) or [])
        if kind == "conversation":
            t_end = time.monotonic()
            self.out.response(ResponseOut(
                rid, getattr(res, "prompt", "") or s.prompt, text, reason, n_tokens, max(0, frame_index), now,
                getattr(res, "detail", "") or "", getattr(res, "model_prompt", "") or "",
                (s.t_first - s.t_accept) if s.t_first else -1.0, t_end - s.t_accept))
            if reason in FINISHED_OK:
                self.report.count("responses")
        elif kind == "memory" and reason in FINISHED_OK:   # failures end with the final token only
            self._memory_entry(rid, res, text, frame_index, n_tokens)

    def _memory_entry(self, rid: int, res, text: str, frame_index: int, n_tokens: int) -> None:
        cap_ns, frame_id = self.frame_info(frame_index)
        cap_ns = cap_ns or self.clock_ns()
        prompt = getattr(res, "prompt", "") or self.default_memory_prompt
        # never raises: a failing database keeps the entry in memory (entry_id 0) and reports it
        entry_id = self.memory.add(text=text, source_prompt=prompt, frame_index=max(0, frame_index), request_id=rid,
                                   num_tokens=n_tokens, stamp_ns=cap_ns, frame_id=frame_id)
        self.out.memory(MemoryOut(entry_id, max(0, frame_index), text, prompt, rid, n_tokens, cap_ns, frame_id))
        self.report.count("memory_entries")

    def _stored_later(self, e: StoredEntry) -> None:
        self.out.memory(memory_out(e))
