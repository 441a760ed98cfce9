"""Language requests and the engine's result types: what a request is (kind, prompt, token budget), its lifecycle
(pending -> active -> finished / rejected / dropped / cancelled), the memory context a conversation may carry
(``with_context``), and the three records the engine hands to its callbacks
(`ActionResult`, `TokenEvent`, `RequestResult`, field names fixed by ARCHITECTURE.md), and `RTCRequest`, the
real-time-chunking input a cycle may take. Pure Python + numpy; the ROS
node imports these types without importing torch-heavy modules beyond what `oxygen_ros.engine` already needs.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

KINDS = ("subtask", "conversation", "memory")

# finish reasons carried by RequestResult.finish_reason
FINISH_EOS = "eos"              # the model produced the end-of-sequence token
FINISH_LENGTH = "length"        # max_new_tokens reached
FINISH_REJECTED = "rejected"    # never admitted (detail says why: too_large, max_wait, ...)
FINISH_DROPPED = "dropped"      # pushed out of the bounded pending queue by newer requests
FINISH_ERROR = "error"          # the cycle that owned it raised; its KV was freed
FINISH_CANCELLED = "cancelled"  # Engine.cancel(): stopped at the next cycle boundary (or before a decode); KV freed
FINISH_REASONS = (FINISH_EOS, FINISH_LENGTH, FINISH_REJECTED, FINISH_DROPPED, FINISH_ERROR, FINISH_CANCELLED)

MEMORY_CONTEXT_PREFIX = "Earlier you saw: "


def with_context(prompt: str, context) -> str:
    """A request text with memory entries (oldest first) prepended: ``"Earlier you saw: a; b. <prompt>"``."""
    entries = [c.strip().rstrip(".") for c in context if c and c.strip()]
    if not entries:
        return prompt
    return f"{MEMORY_CONTEXT_PREFIX}{'; '.join(entries)}. {prompt}"


@dataclass(frozen=True)
class ActionResult:
    """One action chunk, published as soon as denoising of its frame ends."""
    frame_index: int
    chunk_id: int
    stamp: float                 # the observation's stamp (seconds) when it has one, else wall time at frame in
    actions: np.ndarray          # [H, robot_dim] float32, un-normalised robot actions
    latency_ms: float            # frame in (cycle start) -> chunk out
    rtc_ms: float = 0.0          # time of the guided (RTC) sample_actions call when guided, else 0
    guided: bool = False         # the chunk was denoised with real-time-chunking guidance (RTCRequest)


@dataclass
class RTCRequest:
    """Real-time chunking input for one cycle, in the published (un-normalised, robot_dim) action space, BEFORE any
    delta->absolute conversion (i.e. the same space as ActionResult.actions)."""
    prev_actions: np.ndarray      # [n, robot_dim] float32: what the robot will execute from the new chunk's row 0 on
                                  # (row i = the old plan for new row i); n may be < H (rest unguided) or 0 (= no RTC)
    delay_steps: int              # d: rows [0, d) are frozen to prev_actions (executed while inferring)
    execution_horizon: int        # s: rows the robot executes of each chunk before switching (soft-mask end)
    max_guidance_weight: float = 10.0   # beta

    def __post_init__(self):
        a = np.asarray(self.prev_actions, dtype=np.float32)
        if a.size == 0:
            a = a.reshape(0, a.shape[-1] if a.ndim == 2 else 0)
        if a.ndim != 2:
            raise ValueError(f"prev_actions must be [n, robot_dim], got shape {list(a.shape)}")
        if not np.all(np.isfinite(a)):
            raise ValueError("prev_actions contains NaN or inf")
        if int(self.delay_steps) < 0 or int(self.execution_horizon) < 0:
            raise ValueError("delay_steps and execution_horizon must be >= 0")
        if not float(self.max_guidance_weight) >= 0:
            raise ValueError("max_guidance_weight must be >= 0")
        self.prev_actions = a
        self.delay_steps = int(self.delay_steps)
        self.execution_horizon = int(self.execution_horizon)
        self.max_guidance_weight = float(self.max_guidance_weight)

    @property
    def active(self) -> bool:
        """False when there is nothing to guide toward (n == 0): the cycle then runs exactly as without RTC."""
        return self.prev_actions.shape[0] > 0


@dataclass(frozen=True)
class TokenEvent:
    """One generated language token, streamed as soon as it is decoded."""
    request_id: int
    kind: str
    frame_index: int             # the frame whose prefix the request reads
    index: int                   # 0-based index of this token in the request's output
    token_id: int
    text: str                    # decoded text of this token alone ("" for EOS)
    is_final: bool
    stamp: float                 # wall time (time.time())


@dataclass(frozen=True)
class RequestResult:
    """A request's end: finished (eos/length), rejected, dropped or failed."""
    request_id: int
    kind: str
    frame_index: int             # -1 when it was never bound to a frame
    prompt: str
    text: str
    token_ids: list
    stamp: float                 # wall time (time.time())
    finish_reason: str           # one of FINISH_REASONS
    detail: str = ""             # why it was rejected / dropped / failed; "" otherwise
    model_prompt: str = ""       # the request text the model read (memory context included); "" if never encoded


_ids = itertools.count(1)
_ids_lock = threading.Lock()


def next_request_id() -> int:
    with _ids_lock:
        return next(_ids)


@dataclass
class LanguageRequest:
    """A submitted request, before and while it is served. Mutable bookkeeping lives in kv.cache.RequestState."""
    kind: str
    prompt: str
    max_new_tokens: int
    request_id: int = field(default_factory=next_request_id)
    submit_time: float = field(default_factory=time.perf_counter)   # monotonic, for latencies
    submit_stamp: float = field(default_factory=time.time)          # wall
    truncated: bool = False      # the prompt was cut to the engine's max_prompt_tokens
    frames_waited: int = 0       # cycles it spent pending because the cache or batch was full
    eos_token_id: Optional[int] = None   # None = the tokenizer's EOS
    sampling: object = None      # model SamplingParams overriding the engine's (None = the engine's)
    context: tuple = ()          # memory entries (oldest first) prepended to the prompt; oldest dropped to fit
    model_prompt: str = ""       # set at encoding: the text actually tokenised (prompt + the context that fit)
    prompt_ids: object = None    # cached valid prompt token ids (set at encoding)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown request kind {self.kind!r}; expected one of {KINDS}")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")

    def result(self, finish_reason: str, *, frame_index: int = -1, text: str = "", token_ids=(),
               detail: str = "") -> RequestResult:
        return RequestResult(self.request_id, self.kind, frame_index, self.prompt, text, list(token_ids),
                             time.time(), finish_reason, detail, self.model_prompt)
