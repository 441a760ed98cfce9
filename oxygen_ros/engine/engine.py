"""The engine: one `cycle(observation)` per camera frame, in three modes that share all code paths.
`oxygen`: prefill the frame once -> sample the action chunk from that prefix and publish it at once (`on_actions`) ->
bind new language requests to this frame (sharing its prefix KV; in `image_isolated` prefix mode other prompts extend
the frame's image KV in one batched `extend_prefix`, in `upstream` mode they get their own batched prefill) -> decode
k tokens for every in-flight request, from this and earlier frames, in one batched decode call per token (fixed k or
deadline-aware k) -> stream tokens (`on_token`), evict finished requests (`on_finished`).
`shared`: the same single prefill, but each request is decoded to completion inside its frame (no cross-frame batching).
`isolated` (the paper's baseline): actions get their own prefill; each language request then does its own separate
prefill of the frame and is decoded to completion inside the frame, so the next frame's actions wait.
All language KV lives in one preallocated `KVPool` owned by a `KVCacheManager`; `submit()` is thread-safe (bounded
pending queue, oldest dropped when full; a request may carry its own id, sampling overrides and memory context);
`cancel()` is thread-safe and honoured at the next cycle start or before the cycle's decode (finish_reason
"cancelled", KV freed); an exception inside a cycle frees what that cycle allocated and re-raises.
"""
from __future__ import annotations

import itertools
import math
import threading
import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import numpy as np
import torch

from ..kv.cache import KVCacheManager, RequestState
from ..kv.pool import KVPool
from ..model.compiled import COMPILE_MODES, CompiledModel, compile_model, resolve_compile
from ..model.pi05 import DecodeBatch, SamplingParams, sample_tokens
from ..model.rtc import rtc_target, sample_actions_rtc
from ..model.tokenizer import StreamDecoder
from .budget import make_budget
from .metrics import CycleRecord, Metrics
from .requests import (FINISH_CANCELLED, FINISH_DROPPED, FINISH_ERROR, FINISH_REJECTED, ActionResult,
                       LanguageRequest, RequestResult, RTCRequest, TokenEvent, with_context)

MODES = ("isolated", "shared", "oxygen")


@dataclass
class EngineConfig:
    mode: str = "oxygen"                     # isolated | shared | oxygen
    decode_k: object = 5                     # tokens per request per cycle (oxygen): int, or "adaptive"
    max_new_tokens: int = 30                 # N, default per request
    target_period_s: Optional[float] = None  # cycle deadline (adaptive k and deadline-miss counting); None = none
    k_max: int = 64                          # adaptive k upper bound
    max_batch: int = 16                      # language requests in flight at once
    max_pending: int = 64                    # bounded submit queue; when full the oldest pending request is dropped
    max_prompt_tokens: Optional[int] = None  # longer language prompts are truncated (default: cfg.max_token_len)
    max_wait_frames: Optional[int] = None    # reject a request that waited this many cycles for capacity
    kv_budget_mb: Optional[float] = None     # pool size; default: enough for max_batch requests + their frames
    kv_num_blocks: Optional[int] = None      # pool size in blocks (overrides kv_budget_mb)
    kv_block_size: int = 16
    denoise_steps: Optional[int] = None      # S (default cfg.num_denoise_steps)
    seed: int = 0                            # action noise generator seed
    eos_token_id: Optional[int] = None       # default: the tokenizer's / config's EOS
    sampling: Optional[SamplingParams] = None   # None = greedy
    memory_interval_s: Optional[float] = None   # if set, the engine itself submits a memory request this often
    memory_prompt: str = "Describe the scene."
    compile: str = "none"                    # none (eager) | inductor | cudagraphs | inductor-graphs | auto (CUDA:
                                             # cudagraphs, else none): see model/compiled.py; the graphs are built
                                             # by Engine.warmup(), never inside a cycle
    compile_batch_sizes: tuple = (1, 2, 4, 8, 16)   # decode / prompt batch buckets (see compiled.batch_buckets)
    compile_max_context: Optional[int] = None   # decode read length graphs are built for (default: image tokens +
                                                # max_prompt_tokens + max_new_tokens); longer contexts run eagerly

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if isinstance(self.decode_k, str) and self.decode_k != "adaptive":
            self.decode_k = int(self.decode_k)
        if self.decode_k == "adaptive" and not self.target_period_s:
            raise ValueError("decode_k='adaptive' needs target_period_s")
        if self.max_new_tokens < 1 or self.max_batch < 1 or self.max_pending < 1:
            raise ValueError("max_new_tokens, max_batch and max_pending must be >= 1")
        if self.compile not in COMPILE_MODES + ("auto",):
            raise ValueError(f"compile must be auto or one of {COMPILE_MODES}, got {self.compile!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _CycleState:
    """What one cycle allocated, so that a failure can give it back."""

    def __init__(self):
        self.creator_refs = []      # FramePrefix references held by the cycle itself
        self.admitted = []          # RequestStates admitted in this cycle
        self.unbound = []           # drained requests not yet admitted or rejected (requeued on failure)


class Engine:
    def __init__(self, model, processor, config: EngineConfig | None = None, *,
                 on_actions: Optional[Callable[[ActionResult], None]] = None,
                 on_token: Optional[Callable[[TokenEvent], None]] = None,
                 on_finished: Optional[Callable[[RequestResult], None]] = None,
                 pool: KVPool | None = None):
        self.model, self.processor = model, processor
        self.config = config = config or EngineConfig()
        self.cfg = model.cfg
        self.device = next(model.parameters()).device
        self.on_actions, self.on_token, self.on_finished = on_actions, on_token, on_finished
        self.tokenizer = getattr(processor, "tokenizer", None)
        tok_eos = getattr(self.tokenizer, "eos_id", None)
        if config.eos_token_id is not None:
            self.eos_token_id = config.eos_token_id
        else:
            self.eos_token_id = tok_eos if tok_eos is not None else self.cfg.eos_id
        self.max_prompt_tokens = config.max_prompt_tokens or self.cfg.max_token_len
        self.S = config.denoise_steps or self.cfg.num_denoise_steps
        self.pool = pool or self._make_pool()
        self._image_stage = None                 # host buffer of the frame's images (see _frame_inputs)
        max_context = config.compile_max_context or (self.cfg.num_image_tokens + max(self.cfg.max_token_len,
                                                                                     self.max_prompt_tokens)
                                                     + config.max_new_tokens)
        self.model = compile_model(model, resolve_compile(config.compile, self.device), max_batch=config.max_batch,
                                   prompt_len=self.max_prompt_tokens, max_context=max_context,
                                   denoise_steps=self.S, batch_sizes=tuple(config.compile_batch_sizes),
                                   sampled_decode=bool(config.sampling and config.sampling.temperature > 0))
        self.kv = KVCacheManager(self.pool, max_batch=config.max_batch)
        self.budget = make_budget(config.decode_k, config.target_period_s,
                                  **({"k_max": config.k_max} if config.decode_k == "adaptive" else {}))
        self._metrics = Metrics(self.cfg.action_horizon)
        self._lock = threading.Lock()
        self._pending: deque[LanguageRequest] = deque()
        self._request_ids = itertools.count(1)      # per engine: a replayed run numbers its requests the same way
        self._dropped: list[LanguageRequest] = []
        self._live: set[int] = set()          # ids submitted and not yet finished (under _lock)
        self._cancel: set[int] = set()        # live ids whose cancellation is requested (under _lock)
        self._noise_gen = torch.Generator(device="cpu")
        self._noise_gen.manual_seed(config.seed)
        self.frame_index = 0
        self.chunk_id = 0
        self._last_memory_t: Optional[float] = None
        self._kv_snapshot = self.kv.stats()
        self._img_dense = self.cfg.num_image_tokens
        self._streams: dict[int, StreamDecoder] = {}

    # ------------------------------------------------------------------ set-up
    def _make_pool(self) -> KVPool:
        c, cfg = self.config, self.cfg
        dtype = getattr(self.model, "dtype", None) or next(self.model.parameters()).dtype
        if c.kv_num_blocks is None and c.kv_budget_mb is None:
            bs = c.kv_block_size
            per_prefix = -(-cfg.prefix_len // bs)
            per_req = -(-(cfg.max_token_len + c.max_new_tokens) // bs)
            n = (c.max_batch + 2) * per_prefix + c.max_batch * per_req
            return KVPool.from_config(cfg, num_blocks=n, block_size=bs, dtype=dtype, device=self.device)
        return KVPool.from_config(cfg, kv_budget_mb=c.kv_budget_mb, num_blocks=c.kv_num_blocks,
                                  block_size=c.kv_block_size, dtype=dtype, device=self.device)

    def warmup(self) -> dict:
        """Build the compiled graphs (``config.compile`` != none; a no-op otherwise, and when already built for this
        model and shapes).  Call before the first cycle (the node does it at configure).  Returns the compile stats
        (mode in effect, seconds, graphs, error when it fell back to eager)."""
        if isinstance(self.model, CompiledModel):
            self.model.warmup(self.pool)
        return self.compile_stats()

    def compile_stats(self) -> dict:
        if isinstance(self.model, CompiledModel):
            return self.model.stats()
        return {"compile": "none", "compile_requested": "none", "compile_s": 0.0, "compile_graphs": 0,
                "compile_error": "", "eager_calls": {}}

    # ------------------------------------------------------------------ thread-safe submission
    def submit(self, kind: str, prompt: str = "", max_new_tokens: Optional[int] = None, *,
               eos_token_id: Optional[int] = None, request_id: Optional[int] = None, context=(),
               temperature: Optional[float] = None, top_p: Optional[float] = None) -> int:
        """Queue a language request for the next cycle; returns its id: ``request_id`` if given (ids allocated by
        the caller when it accepted the prompt, e.g. the node's pipeline), else the engine's own 1, 2, ... (per
        engine, so a rerun in the same process numbers its requests the same). ``context``: memory entries,
        oldest first, prepended to the prompt (``with_context``; the oldest are left out when the prompt would
        exceed max_prompt_tokens). ``temperature`` / ``top_p`` override the engine's sampling for this request
        (temperature 0 = greedy). Raises ValueError for an unknown kind, a bad max_new_tokens or sampling value, or
        an id already in use. When the pending queue is full the *oldest* pending request is dropped (reported
        through on_finished with finish_reason 'dropped' during the next cycle). Thread-safe."""
        sampling = self._request_sampling(temperature, top_p)
        with self._lock:
            rid = int(request_id) if request_id is not None else next(self._request_ids)
            req = LanguageRequest(kind, prompt or "", int(max_new_tokens or self.config.max_new_tokens),
                                  request_id=rid, eos_token_id=eos_token_id, sampling=sampling,
                                  context=tuple(str(c) for c in context))
            if req.request_id in self._live:
                raise ValueError(f"request id {req.request_id} is already in use")
            self._live.add(req.request_id)
            self._pending.append(req)
            while len(self._pending) > self.config.max_pending:
                self._dropped.append(self._pending.popleft())
        self._metrics.count("submitted")
        return req.request_id

    def _request_sampling(self, temperature, top_p) -> Optional[SamplingParams]:
        """Per-request SamplingParams from overrides (None = use the engine's)."""
        if temperature is None and top_p is None:
            return None
        base = self.config.sampling or SamplingParams()
        t = base.temperature if temperature is None else float(temperature)
        p = base.top_p if top_p is None else float(top_p)
        if not (math.isfinite(t) and t >= 0.0) or not (0.0 < p <= 1.0):
            raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {t}, {p}")
        return SamplingParams(temperature=t, top_p=p, seed=base.seed)

    def _sampling(self, req: LanguageRequest):
        return req.sampling if req.sampling is not None else self.config.sampling

    def cancel(self, request_id: int) -> bool:
        """Ask to stop a pending or decoding request; returns False if it is not live (finished or unknown).
        Honoured at the next cycle start or before this cycle's decode, whichever comes first, so a decoding
        request produces at most one more cycle's tokens; it then ends through on_finished with finish_reason
        'cancelled' and its partial output, and its KV blocks and prefix reference are released. Thread-safe."""
        with self._lock:
            if request_id not in self._live:
                return False
            self._cancel.add(int(request_id))
            return True

    def _apply_cancels(self, cs: "_CycleState") -> None:
        """End the requests whose cancellation was asked (inference thread, between cycle phases)."""
        with self._lock:
            if not self._cancel:
                return
            ids, self._cancel = self._cancel, set()
            waiting = [r for r in self._pending if r.request_id in ids]
            for r in waiting:
                self._pending.remove(r)
        waiting += [r for r in cs.unbound if r.request_id in ids]
        for r in waiting:
            if r in cs.unbound:
                cs.unbound.remove(r)
            self._metrics.count("cancelled")
            self._emit_finished(r.result(FINISH_CANCELLED, detail="cancelled before it was admitted"))
        now = time.perf_counter()
        for rid in ids:
            st = self.kv.requests.get(rid)
            if st is None:
                continue
            self._streams.pop(rid, None)
            self.kv.finish(st, FINISH_CANCELLED, now)
            self._metrics.count("cancelled")
            self._emit_finished(st.request.result(FINISH_CANCELLED, frame_index=st.frame_index,
                                                  text=self._text(st.generated), token_ids=st.generated))

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def active(self) -> int:
        return self._kv_snapshot["kv_active_requests"]

    # ------------------------------------------------------------------ processor adapters
    def _frame_inputs(self, observation):
        """-> (images [1,C,3,S,S], image_masks [1,C], tokens [1,L], token_masks [1,L]) on the model device.  The
        images are written into one host buffer kept for the engine's life (pinned on CUDA, so the copy to the
        device is asynchronous; the next frame writes it only after the cycle-start synchronisation)."""
        dev = self.device
        if self._image_stage is None:
            cfg = self.cfg
            self._image_stage = torch.empty(1, cfg.num_cameras, 3, cfg.image_size, cfg.image_size,
                                            pin_memory=dev.type == "cuda")
        mi = self.processor.prepare(observation, images_out=self._image_stage)
        if mi.truncated:
            self._metrics.count("truncated_action_prompts")
        return (mi.images.to(dev, non_blocking=True), mi.image_masks.to(dev), mi.tokens.to(dev),
                mi.token_masks.to(dev))

    def _language_tokens(self, req: LanguageRequest) -> torch.Tensor:
        """Valid prompt token ids of a conversation / memory request (memory context prepended, its oldest entries
        left out until the prompt fits), truncated to max_prompt_tokens; computed once per request."""
        if req.prompt_ids is not None:
            return req.prompt_ids
        context = list(req.context)
        while True:
            text = with_context(req.prompt, context)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")          # counted below instead of warning once per request
                toks, mask, truncated = self.processor.encode_prompt(req.kind, text)
            ids = toks[0][mask[0]]
            if not context or (not truncated and ids.numel() <= self.max_prompt_tokens):
                break
            context.pop(0)
        if len(context) < len(req.context):
            self._metrics.count("memory_context_trimmed")
        if ids.numel() > self.max_prompt_tokens:
            ids, truncated = ids[:self.max_prompt_tokens], True
        if truncated:
            req.truncated = True
            self._metrics.count("truncated_prompts")
        req.model_prompt, req.prompt_ids = text, ids
        return ids

    def _stream_piece(self, rid: int, token_id: int, final: bool) -> str:
        if self.tokenizer is None:
            return ""
        dec = self._streams.get(rid)
        if dec is None:
            dec = self._streams[rid] = StreamDecoder(self.tokenizer)
        piece = "" if token_id == self.eos_token_id else dec.push(token_id)
        if final:
            piece += dec.flush()
            del self._streams[rid]
        return piece

    def _text(self, ids: list) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([t for t in ids if t != self.eos_token_id])

    # ------------------------------------------------------------------ the cycle
    def cycle(self, observation, *, noise: Optional[torch.Tensor] = None, rtc: Optional[RTCRequest] = None) -> dict:
        """Process one frame; returns this cycle's stats (a flat dict). Publishes the action chunk through
        on_actions before any language work. Runs on the caller's thread (the node's inference thread).
        ``rtc``: real-time chunking input; the chunk is then denoised with guidance toward ``rtc.prev_actions``
        (``model/rtc.py``); None or an empty prev_actions = exactly the unguided path."""
        dev = self.device
        _sync(dev)
        t0 = time.perf_counter()
        fi = self.frame_index
        self.frame_index += 1
        c = self.config
        if c.memory_interval_s and (self._last_memory_t is None or t0 - self._last_memory_t >= c.memory_interval_s):
            self._last_memory_t = t0
            self.submit("memory", c.memory_prompt)
        with self._lock:
            drained = list(self._pending)
            self._pending.clear()
            dropped, self._dropped = self._dropped, []
        for req in dropped:
            self._metrics.count("dropped")
            self._emit_finished(req.result(FINISH_DROPPED, detail="pending queue full"))
        cs = _CycleState()
        cs.unbound = drained
        self._apply_cancels(cs)
        self.kv.begin_cycle()
        rec = dict(tokens=0, prefills=0, prompt_extends=0, decode_steps=0, batch_sizes=[], admitted=0, k=0,
                   t_prefill=0.0, t_actions=0.0, t_decode=0.0)
        try:
            t_act = self._actions_and_admission(observation, noise, fi, t0, cs, rec, rtc)
            if c.mode == "oxygen":
                self._apply_cancels(cs)
                self._decode_oxygen(t0, rec)
        except BaseException:
            self._rollback(cs, fi)
            raise
        finally:
            self._snapshot()
        _sync(dev)
        t1 = time.perf_counter()
        duration = t1 - t0
        missed = self.budget.end_cycle(duration, explained_s=rec.pop("explained", 0.0))
        r = CycleRecord(fi, t0, duration, t_act - t0, rec["tokens"], rec["prefills"], rec["prompt_extends"],
                        rec["decode_steps"], rec["batch_sizes"], self.kv.num_active, rec["admitted"], rec["k"],
                        missed, self.pool.used_bytes, self.kv.live_tokens, rec["t_prefill"], rec["t_actions"],
                        rec["t_decode"])
        self._metrics.add_cycle(r)
        out = asdict(r)
        out.pop("batch_sizes")
        out["batch_size_max"] = max(rec["batch_sizes"], default=0)
        out["decode_rows"] = sum(rec["batch_sizes"])
        out["pending"] = self.pending()
        return out

    def _rollback(self, cs: _CycleState, fi: int) -> None:
        self._metrics.count("cycle_errors")
        for st in cs.admitted:
            self._streams.pop(st.request_id, None)
            if not st.finished:
                self.kv.finish(st, FINISH_ERROR)
                self._metrics.count("errors")
                try:
                    self._emit_finished(st.request.result(FINISH_ERROR, frame_index=fi, text=self._text(st.generated),
                                                          token_ids=st.generated, detail="cycle failed"))
                except Exception:
                    pass
        for fp in cs.creator_refs:
            self.kv.release(fp)
        cs.creator_refs = []
        for st in list(self.kv.requests.values()):
            self.kv.trim(st)
        if cs.unbound:
            with self._lock:
                self._pending.extendleft(reversed(cs.unbound))

    def _snapshot(self) -> None:
        snap = self.kv.stats()
        with self._lock:
            self._kv_snapshot = snap

    # ------------------------------------------------------------------ steps 1-3: prefill, actions, admission
    def _noise(self) -> torch.Tensor:
        cfg = self.cfg
        return torch.randn((1, cfg.action_horizon, cfg.action_dim), generator=self._noise_gen).to(self.device)

    def _actions_and_admission(self, observation, noise, fi, t0, cs: _CycleState, rec, rtc=None) -> float:
        c, model = self.config, self.model
        images, image_masks, tokens, token_masks = self._frame_inputs(observation)
        if noise is None:
            noise = self._noise()
        noise = noise.to(self.device)
        isolated = c.mode == "isolated"
        pending = cs.unbound
        want_logits = (not isolated) and any(r.kind == "subtask" for r in pending)
        # 1. one prefill of the frame (in isolated mode: the action's own)
        tp = time.perf_counter()
        prefix = model.prefill(images, image_masks, tokens, token_masks, want_logits=want_logits)
        rec["prefills"] += 1
        _sync(self.device)
        # 2. actions, published at once
        ta = time.perf_counter()
        rec["t_prefill"] += ta - tp
        guided = rtc is not None and rtc.active
        if guided:
            actions = self._sample_actions_rtc(prefix, noise, rtc)
        else:
            actions = model.sample_actions(prefix, noise, self.S)
        acts = self.processor.unnormalize_actions(actions[0])
        _sync(self.device)
        t_act = time.perf_counter()
        rec["t_actions"] += t_act - ta
        self.budget.observe_prefill(ta - tp)
        self.budget.observe_actions(t_act - ta)
        stamp = getattr(observation, "stamp", None)
        res = ActionResult(fi, self.chunk_id, float(stamp) if stamp is not None else time.time(),
                           np.asarray(acts, dtype=np.float32), (t_act - t0) * 1e3,
                           rtc_ms=(t_act - ta) * 1e3 if guided else 0.0, guided=guided)
        self.chunk_id += 1
        if self.on_actions is not None:
            self.on_actions(res)
        rec["explained"] = t_act - t0
        if not pending:
            return t_act
        # 3. admission
        if isolated:
            self._serve_isolated(images, image_masks, tokens, token_masks, fi, cs, rec)
        else:
            self._admit_shared(observation, prefix, images, image_masks, fi, cs, rec)
            if c.mode == "shared" and cs.admitted:
                rows = [st for st in cs.admitted if not st.finished]
                if rows:
                    td = time.perf_counter()
                    self._run_decode(rows, [st.tokens_left for st in rows], rec)
                    rec["explained"] += time.perf_counter() - td
        return t_act

    def _sample_actions_rtc(self, prefix, noise, rtc: RTCRequest) -> torch.Tensor:
        """Guided denoise (model/rtc.py): prev_actions normalised with the processor's action stats, the model's dims
        beyond robot_dim and rows beyond n weighted 0."""
        prev = torch.from_numpy(self.processor.normalize_actions(rtc.prev_actions)).to(self.device)
        target, weights = rtc_target(prev, self.cfg.action_horizon, self.cfg.action_dim, rtc.delay_steps,
                                     rtc.execution_horizon)
        return sample_actions_rtc(self.model, prefix, noise, self.S, target, weights, rtc.max_guidance_weight)

    def _first_token(self, logits_row: torch.Tensor, position: int, sampling) -> int:
        if sampling is None or sampling.temperature <= 0:        # greedy: no position tensor to build
            return int(logits_row.argmax())
        return int(sample_tokens(logits_row[None].float(), [sampling],
                                 torch.tensor([position], dtype=torch.long, device=logits_row.device))[0])

    def _reject_or_wait(self, decisions, cands, cs: _CycleState, fi: int):
        """Apply plan_admission decisions: rejected -> on_finished; waiting -> stay pending. Returns admitted."""
        admitted, waiting = [], []
        for req, d in zip(cands, decisions):
            if d is None:
                admitted.append(req)
            elif d[0] == "reject":
                self._reject(req, d[1], cs)
            else:
                req.frames_waited += 1
                if self.config.max_wait_frames is not None and req.frames_waited > self.config.max_wait_frames:
                    self._reject(req, f"max_wait: {d[1]}", cs)
                else:
                    waiting.append(req)
        if waiting:
            for r in waiting:
                cs.unbound.remove(r)
            with self._lock:
                self._pending.extendleft(reversed(waiting))
                while len(self._pending) > self.config.max_pending:
                    self._dropped.append(self._pending.popleft())
        return admitted

    def _reject(self, req, reason, cs):
        cs.unbound.remove(req)
        self._metrics.count("rejected")
        self._emit_finished(req.result(FINISH_REJECTED, detail=reason))

    def _admit_shared(self, observation, prefix, images, image_masks, fi, cs: _CycleState, rec) -> None:
        """shared / oxygen: bind pending requests to this frame's prefix."""
        cfg, kv = self.cfg, self.kv
        iso_prefix = cfg.prefix_attention == "image_isolated"
        pend = list(cs.unbound)
        lang = {r.request_id: self._language_tokens(r) for r in pend if r.kind != "subtask"}
        mask0 = prefix.mask[0]
        n_full = int(mask0.sum())
        n_img = int(mask0[:self._img_dense].sum())
        any_sub = any(r.kind == "subtask" for r in pend)
        shared_blocks = self.pool.blocks_for(n_full if (any_sub or not iso_prefix) else n_img)
        if not any_sub and not iso_prefix:
            shared_blocks = 0
        needs = []
        for r in pend:
            if r.kind == "subtask":
                needs.append(kv.request_blocks(0, r.max_new_tokens))
            elif iso_prefix:
                needs.append(kv.request_blocks(len(lang[r.request_id]), r.max_new_tokens))
            else:   # upstream: own prefill, stored privately
                own = n_img + len(lang[r.request_id])
                needs.append(self.pool.blocks_for(own) + kv.request_blocks(0, r.max_new_tokens))
        admitted = self._reject_or_wait(kv.plan_admission(needs, shared_blocks), pend, cs, fi)
        if not admitted:
            return
        subs = [r for r in admitted if r.kind == "subtask"]
        others = [r for r in admitted if r.kind != "subtask"]
        now = time.perf_counter()
        fp = None
        if subs or (others and iso_prefix):
            stop = None if subs else self._img_dense
            fp = kv.store_prefix(prefix, 0, frame_index=fi, stop=stop, image_positions=self._img_dense)
            cs.creator_refs.append(fp)
        for r in subs:
            cs.unbound.remove(r)
            tok = self._first_token(prefix.last_logits[0], fp.next_position - 1, self._sampling(r))
            st = kv.admit(r, fp, shared_len=fp.length, first_token=tok, max_new_tokens=r.max_new_tokens,
                          eos_token_id=self._eos(r), sampling=self._sampling(r), frame_index=fi, now=now)
            cs.admitted.append(st)
            self._after_admit(st, rec)
        if others:
            toks, tmask = self._pad([lang[r.request_id] for r in others])
            tp = time.perf_counter()
            if iso_prefix:
                img = prefix.head(self._img_dense)
                ext = self.model.extend_prefix(img, toks, tmask, want_logits=True)
                rec["prompt_extends"] += 1
                own = None
            else:
                B2 = len(others)
                own = self.model.prefill(images.expand(B2, *images.shape[1:]),
                                         image_masks.expand(B2, *image_masks.shape[1:]), toks, tmask,
                                         want_logits=True)
                rec["prefills"] += 1
            _sync(self.device)
            rec["t_prefill"] += time.perf_counter() - tp
            now = time.perf_counter()
            for j, r in enumerate(others):
                cs.unbound.remove(r)
                if iso_prefix:
                    pos = int(ext.next_position[j]) - 1
                    tok = self._first_token(ext.last_logits[j], pos, self._sampling(r))
                    st = kv.admit(r, fp, shared_len=fp.image_length, first_token=tok, max_new_tokens=r.max_new_tokens,
                                  eos_token_id=self._eos(r), sampling=self._sampling(r), frame_index=fi,
                                  private_prompt=(ext, j, self._img_dense), now=now)
                else:
                    ofp = kv.store_prefix(own, j, frame_index=fi, image_positions=self._img_dense, private=True)
                    cs.creator_refs.append(ofp)
                    tok = self._first_token(own.last_logits[j], ofp.next_position - 1, self._sampling(r))
                    st = kv.admit(r, ofp, shared_len=ofp.length, first_token=tok, max_new_tokens=r.max_new_tokens,
                                  eos_token_id=self._eos(r), sampling=self._sampling(r), frame_index=fi, now=now)
                    cs.creator_refs.remove(ofp)
                    kv.release(ofp)
                cs.admitted.append(st)
                self._after_admit(st, rec)
        if fp is not None:
            cs.creator_refs.remove(fp)
            kv.release(fp)

    def _serve_isolated(self, images, image_masks, frame_tokens, frame_token_masks, fi, cs: _CycleState, rec) -> None:
        """isolated: each request gets its own prefill of this frame and is decoded to completion, one by one."""
        kv = self.kv
        for r in list(cs.unbound):
            if r.kind == "subtask":      # the action prompt again, in its own prefill
                toks, tmask = frame_tokens, frame_token_masks
            else:
                toks, tmask = self._pad([self._language_tokens(r)])
            n_own = int(image_masks[0].sum()) * self.cfg.image_tokens_per_camera + int(tmask.sum())
            need = self.pool.blocks_for(n_own) + kv.request_blocks(0, r.max_new_tokens)
            if not self._reject_or_wait(kv.plan_admission([need]), [r], cs, fi):
                continue
            td = time.perf_counter()
            own = self.model.prefill(images, image_masks, toks, tmask, want_logits=True)
            rec["prefills"] += 1
            _sync(self.device)
            rec["t_prefill"] += time.perf_counter() - td
            cs.unbound.remove(r)
            ofp = kv.store_prefix(own, 0, frame_index=fi, image_positions=self._img_dense, private=True)
            cs.creator_refs.append(ofp)
            tok = self._first_token(own.last_logits[0], ofp.next_position - 1, self._sampling(r))
            st = kv.admit(r, ofp, shared_len=ofp.length, first_token=tok, max_new_tokens=r.max_new_tokens,
                          eos_token_id=self._eos(r), sampling=self._sampling(r), frame_index=fi,
                          now=time.perf_counter())
            cs.creator_refs.remove(ofp)
            kv.release(ofp)
            cs.admitted.append(st)
            self._after_admit(st, rec)
            if not st.finished:
                self._run_decode([st], [st.tokens_left], rec)
            rec["explained"] += time.perf_counter() - td

    def _eos(self, req: LanguageRequest):
        return req.eos_token_id if req.eos_token_id is not None else self.eos_token_id

    def _pad(self, seqs: list) -> tuple[torch.Tensor, torch.Tensor]:
        L = max(1, max(len(s) for s in seqs))
        toks = torch.full((len(seqs), L), self.cfg.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), L), dtype=torch.bool)
        for i, s in enumerate(seqs):
            toks[i, :len(s)] = s
            mask[i, :len(s)] = True
        return toks.to(self.device), mask.to(self.device)

    def _after_admit(self, st: RequestState, rec) -> None:
        """Stream token 0 (from the prefix logits) and finish at once if it already ends the request."""
        rec["admitted"] += 1
        rec["tokens"] += 1
        reason = self.kv.check_finished(st)
        now = time.perf_counter()
        if reason is not None:
            self.kv.finish(st, reason, now)
        self._emit_token(st, st.generated[0], 0, reason is not None)
        if reason is not None:
            self._finished(st)

    # ------------------------------------------------------------------ step 4: batched decode
    def _decode_oxygen(self, t0: float, rec) -> None:
        rows = list(self.kv.requests.values())
        if not rows:
            return
        elapsed = time.perf_counter() - t0
        k = self.budget.tokens_this_cycle(len(rows), elapsed)
        rec["k"] = k
        if self.budget.adaptive:       # k = decode calls this cycle; every row takes part (>= 1 step each)
            steps = [min(k, st.tokens_left) for st in rows]
        else:                          # k = tokens per request per frame (the paper); token 0 came from the prefill
            steps = [min(k - st.tokens_this_cycle, st.tokens_left) for st in rows]
        sel = [(st, s) for st, s in zip(rows, steps) if s > 0]
        if sel:
            td = time.perf_counter()
            self._run_decode([s[0] for s in sel], [s[1] for s in sel], rec)
            rec["explained"] += time.perf_counter() - td

    def _run_decode(self, rows: list, steps: list, rec) -> None:
        kv, model = self.kv, self.model
        plan = kv.plan_decode(rows, steps)
        token_ids = torch.tensor([st.last_token for st in rows], dtype=torch.long, device=self.device)
        while plan.active:
            positions, write, read, mask = kv.step_tensors(plan)
            act = plan.active
            sampling = None
            if any(plan.rows[r].sampling is not None for r in act):
                sampling = [plan.rows[r].sampling or SamplingParams() for r in act]
            ts = time.perf_counter()
            out = model.decode(DecodeBatch(token_ids, positions, write, read, mask, sampling), self.pool)
            ids = out.next_ids.tolist()                              # the step's one host sync
            dt = time.perf_counter() - ts
            rec["t_decode"] += dt
            self.budget.observe_step(len(act), dt)
            rec["decode_steps"] += 1
            rec["batch_sizes"].append(len(act))
            rec["tokens"] += len(ids)
            prev = list(act)
            results = kv.commit_step(plan, ids, time.perf_counter())
            for st, tok, reason in results:
                self._emit_token(st, tok, len(st.generated) - 1, reason is not None)
                if reason is not None:
                    self._finished(st)
            if plan.active and plan.active != prev:
                where = {r: i for i, r in enumerate(prev)}
                sel = torch.tensor([where[r] for r in plan.active], dtype=torch.long, device=self.device)
                token_ids = out.next_ids.index_select(0, sel)
            else:
                token_ids = out.next_ids

    # ------------------------------------------------------------------ streaming
    def _emit_token(self, st: RequestState, tok: int, index: int, final: bool) -> None:
        if self.on_token is not None:
            req = st.request
            self.on_token(TokenEvent(req.request_id, req.kind, st.frame_index, index, tok,
                                     self._stream_piece(req.request_id, tok, final), final, time.time()))

    def _finished(self, st: RequestState) -> None:
        req = st.request
        self._metrics.add_request(st.t_first_token - req.submit_time, st.t_finish - req.submit_time,
                                  len(st.generated), st.finish_reason)
        self._emit_finished(req.result(st.finish_reason, frame_index=st.frame_index, text=self._text(st.generated),
                                       token_ids=st.generated))

    def _emit_finished(self, res: RequestResult) -> None:
        with self._lock:
            self._live.discard(res.request_id)
            self._cancel.discard(res.request_id)
        if self.on_finished is not None:
            self.on_finished(res)

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict:
        """Flat, JSON-serialisable metrics of the run so far (thread-safe)."""
        with self._lock:
            snap = dict(self._kv_snapshot)
            pend = len(self._pending)
        cs = self.compile_stats()
        extra = {"mode": self.config.mode, "decode_k": self.config.decode_k, "denoise_steps": self.S,
                 "device": str(self.device), "dtype": str(self.model.dtype).removeprefix("torch."),
                 "compile": cs["compile"], "compile_s": cs["compile_s"], "compile_graphs": cs["compile_graphs"],
                 "compile_eager_calls": sum(cs["eager_calls"].values()),
                 "pending": pend, "kv_block_size": self.pool.block_size, **snap, **self.budget.state()}
        return self._metrics.summary(extra)

    def reset_metrics(self) -> None:
        """Forget recorded cycles/requests (e.g. after warm-up); resets KV peaks and budget miss counts."""
        self._metrics.reset()
        self.kv.reset_peak()
        self.budget.deadline_misses = 0
        self.budget.cycles = 0
        self._snapshot()

    def drain(self, observation, max_cycles: int = 10_000) -> int:
        """Run cycles on `observation` until no request is active or pending; returns the cycles run."""
        n = 0
        while (self.kv.num_active or self.pending()) and n < max_cycles:
            self.cycle(observation)
            n += 1
        return n

