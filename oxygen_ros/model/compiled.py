"""Static-shape, compiled execution of the model's primitives (``compile: none | inductor | cudagraphs |
inductor-graphs``, ``auto`` resolved by ``resolve_compile``).

``CompiledModel`` wraps a ``Pi05Model`` and offers the same four primitives the engine calls (``prefill``,
``extend_prefix``, ``sample_actions``, ``decode``), so the engine's code paths do not change with the setting.  Each
call is padded to one of a few fixed shapes and run through a graph compiled for that shape:

- prefill / extend_prefix: the prompt is padded to a fixed length (``cfg.max_token_len``, or the engine's
  ``max_prompt_tokens``) and the batch to a batch bucket; padded rows and tokens are masked (an invalid token sees only
  itself and is seen by nobody), so the valid rows' K/V and logits equal the unpadded call's (up to float rounding);
- sample_actions: the whole S-step Euler loop for the fixed prefix length ``C*N + max_token_len`` is one graph;
- decode: batch padded to a bucket (padded rows repeat row 0: same token, position, write slot and reads, so the
  duplicate write stores the same values) and the read length to ``max_context`` (padding reads masked out);
  sampling runs inside the step (``pi05.sample_rows`` with the uniforms drawn on the host beforehand), and the next
  ids stay on the device until the engine's one host read per step.

The graphs hold no host synchronisation and compile with ``fullgraph=True``.  All of them are compiled (and, for
``cudagraphs``, captured) in ``warmup()``, which the engine runs when it is built (the node: at configure), never in a
control cycle; a call whose shape has no warmed graph (a longer context than ``max_context``, a sampled decode when
only greedy graphs were warmed, ...) runs eagerly and is counted in ``stats()["eager_calls"]``.  ``inductor`` =
``torch.compile`` (CPU and GPU); ``cudagraphs`` = ``torch.compile(mode="reduce-overhead")`` (inductor's kernels in
CUDA graphs per shape, managed by torch's cudagraph trees; the KV pool tensors are marked static so the in-place K/V
writes are captured; outputs are cloned before the next replay can overwrite them); ``inductor-graphs`` =
``torch.compile(mode="max-autotune-no-cudagraphs")`` (tuned GEMM / fused elementwise kernels) captured in this
file's own ``torch.cuda.CUDAGraph`` per shape (``CapturedGraph``: a call copies its inputs into the graph's static
buffers and replays, no guard checks or tree bookkeeping on the host; the KV pool is used in place; for the actions
only ``Pi05Model.denoise_step`` is compiled - one step, not S unrolled ones - and the whole S-step call is captured
around it, so the S steps are still one graph replay).  Both graph
modes need CUDA; on another device they run as ``inductor`` with a warning.  A compile failure turns the whole
wrapper eager with a warning (never a dead node).  ``none`` is the identity (the model's own eager methods).
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .pi05 import DecodeBatch, DecodeOutput, Pi05Model, Prefix, SamplerInputs

COMPILE_MODES = ("none", "inductor", "cudagraphs", "inductor-graphs")
GRAPH_MODES = ("cudagraphs", "inductor-graphs")                 # CUDA only: fall back to inductor elsewhere
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16)
# compile: auto on CUDA = the fastest path measured on a GPU (bench/results/*-gpu-bench: oxygen frame 70.3 ms with
# cudagraphs vs 335.6 ms eager on an H200); inductor-graphs is not measured on a GPU yet
AUTO_CUDA_COMPILE = "cudagraphs"


def resolve_device(device: str = "auto") -> str:
    """``auto`` -> ``cuda`` when ``torch.cuda.is_available()``, else ``cpu``; anything else unchanged."""
    if device in ("", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_compile(mode: str, device) -> str:
    """``auto`` -> ``AUTO_CUDA_COMPILE`` on a CUDA device, ``none`` (eager) elsewhere; anything else unchanged (checked
    against ``COMPILE_MODES``).  The node, bag-eval, sim-eval, the demo and the benchmark resolve through here."""
    if mode == "auto":
        return AUTO_CUDA_COMPILE if torch.device(resolve_device(str(device))).type == "cuda" else "none"
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be auto or one of {COMPILE_MODES}, got {mode!r}")
    return mode


def batch_buckets(max_batch: int, buckets=DEFAULT_BATCH_BUCKETS) -> tuple[int, ...]:
    """The decode / prompt batch sizes that get a graph: the ``buckets`` below ``max_batch``, and ``max_batch`` itself
    when it is not above the largest bucket (larger batches then run eagerly).  E.g. (1,2,4,8,16) with max_batch 6 ->
    (1, 2, 4, 6); (1, 8) with max_batch 16 -> (1, 8)."""
    out = {int(b) for b in buckets if 0 < b < max_batch}
    if max_batch <= max(buckets):
        out.add(int(max_batch))
    return tuple(sorted(out))


def _bucket(n: int, sizes) -> int | None:
    for s in sizes:
        if n <= s:
            return s
    return None


def _pad_rows(t: Tensor, B: int, fill=None) -> Tensor:
    """t [b, ...] -> [B, ...]: extra rows are ``fill`` (a scalar) or, when None, copies of row 0."""
    b = t.shape[0]
    if b == B:
        return t
    extra = t[:1].expand(B - b, *t.shape[1:]) if fill is None else t.new_full((B - b, *t.shape[1:]), fill)
    return torch.cat([t, extra], 0)


def _pad_cols(t: Tensor, L: int, fill) -> Tensor:
    """t [B, l] -> [B, L] padded with ``fill`` (a scalar or a [B] tensor)."""
    l = t.shape[1]
    if l == L:
        return t
    if isinstance(fill, Tensor):
        return torch.cat([t, fill[:, None].expand(t.shape[0], L - l)], 1)
    return torch.cat([t, t.new_full((t.shape[0], L - l), fill)], 1)


def _kv_only(prefix: Prefix) -> Prefix:
    """The prefix without ``last_logits`` (sample_actions never reads them): one argument structure per graph."""
    return prefix if prefix.last_logits is None else dataclasses.replace(prefix, last_logits=None)


def _rows(prefix: Prefix, B: int) -> Prefix:
    if prefix.batch_size == B:
        return prefix
    return Prefix([k[:B] for k in prefix.k], [v[:B] for v in prefix.v], prefix.mask[:B], prefix.positions[:B],
                  prefix.next_position[:B], None if prefix.last_logits is None else prefix.last_logits[:B])


def _tensors(x):
    """The tensors of an argument structure (tensors, lists / tuples, dataclasses such as Prefix, None), in order."""
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            yield from _tensors(getattr(x, f.name))


def _map_tensors(fn, x):
    if isinstance(x, Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map_tensors(fn, y) for y in x)
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: _map_tensors(fn, getattr(x, f.name)) for f in dataclasses.fields(x)})
    return x


class CapturedGraph:
    """``fn(*args)`` captured once in a ``torch.cuda.CUDAGraph`` (``inductor-graphs``).  The graph reads static copies
    of ``args`` - except the tensors in ``static`` (the KV pool), which it uses in place - and a call copies the new
    arguments (same structure and shapes) into them, replays, and returns the static outputs, which the next replay
    overwrites (the caller copies what outlives it).  ``fn`` runs three times on a side stream before the capture
    (compilation and autotuning happen there, not in the graph)."""

    def __init__(self, fn, args: tuple, static=(), pool=None):
        keep = {id(t) for t in static}
        self.args = _map_tensors(lambda t: t if id(t) in keep else t.clone(), args)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn(*self.args)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn(*self.args)

    def __call__(self, *args):
        for dst, src in zip(_tensors(self.args), _tensors(args), strict=True):
            if dst is not src:
                dst.copy_(src)
        self.graph.replay()
        return self.out


@dataclass
class CompileReport:
    mode: str                                   # the mode in effect ("none" after a fallback)
    requested: str
    compile_s: float = 0.0                      # wall time of warmup()
    graphs: dict = field(default_factory=dict)  # graph key -> compile (first call) seconds
    error: str = ""                             # why it fell back to eager, if it did


class CompiledModel:
    """``Pi05Model``'s primitives at static shapes, compiled once.  Attribute access falls through to the model."""

    def __init__(self, model: Pi05Model, mode: str = "inductor", *, max_batch: int = 16, prompt_len: int | None = None,
                 max_context: int | None = None, max_new_tokens: int = 30, denoise_steps: int | None = None,
                 batch_sizes=DEFAULT_BATCH_BUCKETS, sampled_decode: bool = False):
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
        self.model = model
        cfg = self.cfg = model.cfg
        self.requested = mode
        if mode in GRAPH_MODES and model.device.type != "cuda":
            warnings.warn(f"compile={mode!r} needs a CUDA device (model is on {model.device}); using 'inductor'")
            mode = "inductor"
        self.mode = mode
        self.S = denoise_steps or cfg.num_denoise_steps
        self.batch_sizes = batch_buckets(max_batch, batch_sizes)
        self.prompt_lens = tuple(sorted({cfg.max_token_len, int(prompt_len or cfg.max_token_len)}))
        self.max_context = int(max_context or (cfg.num_image_tokens + max(self.prompt_lens) + max_new_tokens))
        self.sampled_decode = sampled_decode
        self._graphs: dict = {}                 # key -> compiled callable (present = warmed)
        self._pools: set = set()                # pools the decode graphs were warmed for (see _pool_key)
        self._mempool = torch.cuda.graph_pool_handle() if mode == "inductor-graphs" else None   # shared by graphs
        self._step = None                       # inductor-graphs: the compiled denoise step
        self.eager_calls: dict[str, int] = {}
        self.report = CompileReport(self.mode, self.requested)

    def __getattr__(self, name):                # cfg, dtype, device, parameters(), embed_images, ...
        return getattr(self.__dict__["model"], name)

    # ------------------------------------------------------------------ compilation
    def _compile(self, fn):
        if self.mode == "cudagraphs":
            return torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)
        if self.mode == "inductor-graphs":
            return torch.compile(fn, mode="max-autotune-no-cudagraphs", fullgraph=True, dynamic=False)
        return torch.compile(fn, fullgraph=True, dynamic=False)

    def _graph_fns(self):
        m = self.model
        if self.mode == "inductor-graphs":      # one compiled step; the capture records all S of them
            step = self._step = self._step or self._compile(m.denoise_step)
            actions = lambda p, noise: m.sample_actions(p, noise, self.S, step=step)  # noqa: E731
        else:
            actions = lambda p, noise: m.sample_actions(p, noise, self.S)  # noqa: E731
        return {
            "prefill": lambda *a: m.prefill(*a, want_logits=True),
            "extend": lambda p, t, tm: m.extend_prefix(p, t, tm, want_logits=True),
            "actions": actions,
            "decode": lambda ids, pos, ws, rs, rm, k, v: m.decode_step(ids, pos, ws, rs, rm, k, v, None),
            "decode_sampled": lambda ids, pos, ws, rs, rm, k, v, s: m.decode_step(ids, pos, ws, rs, rm, k, v, s),
        }

    def warmup(self, pool=None) -> CompileReport:
        """Compile (and capture) every graph this configuration can use, by running each once (three times for
        cudagraphs) on dummy inputs; ``pool`` = the engine's KVPool (decode graphs read and write it; warm-up writes
        only slot 0, which must be free).  Idempotent per pool.  With cudagraphs a graph holds the pool's addresses,
        so each new pool gets its own decode graphs (its tensors are marked static); with inductor one set serves
        every pool of the same shape.  On any failure: warns, and every primitive runs eagerly."""
        if self.mode == "none" or (self._graphs and (pool is None or self._pool_key(pool) in self._pools)):
            return self.report
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                if not self._graphs:
                    self._warm_all()
                if pool is not None:
                    self._warm_decode(pool)
        except Exception as e:                              # noqa: BLE001 - any compiler failure: run eagerly
            self._graphs.clear()
            self.report.error = f"{type(e).__name__}: {e}".splitlines()[0][:500]
            warnings.warn(f"compile={self.requested!r} failed, running eagerly: {self.report.error}")
            self.mode = self.report.mode = "none"
        self.report.compile_s += time.perf_counter() - t0
        return self.report

    def _pool_key(self, pool):
        return pool.k[0].data_ptr() if self.mode in GRAPH_MODES else "any"

    def _warm(self, key, fn, *args, static=()):
        g = fn if self.mode == "inductor-graphs" and key[0] == "actions" else self._compile(fn)
        t = time.perf_counter()
        if self.mode == "inductor-graphs":
            g = CapturedGraph(g, args, static, self._mempool)
            out = g.out
        for _ in range(3 if self.mode == "cudagraphs" else 1 if self.mode == "inductor" else 0):
            if self.mode == "cudagraphs":
                torch.compiler.cudagraph_mark_step_begin()
            out = g(*args)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        self.report.graphs["/".join(map(str, key[:3]))] = round(time.perf_counter() - t, 3)
        self._graphs[key] = g
        return out

    def _warm_all(self) -> None:
        cfg, dev = self.cfg, self.model.device
        fns = self._graph_fns()
        C, S = cfg.num_cameras, cfg.image_size
        images = torch.zeros(1, C, 3, S, S, device=dev)
        masks = torch.ones(1, C, dtype=torch.bool, device=dev)
        L0 = cfg.max_token_len
        toks = torch.full((1, L0), cfg.pad_id, dtype=torch.long, device=dev)
        tmask = torch.zeros(1, L0, dtype=torch.bool, device=dev)
        tmask[:, :1] = True
        prefix = self._own(self._warm(("prefill", 1, L0), fns["prefill"], images, masks, toks, tmask))
        noise = torch.zeros(1, cfg.action_horizon, cfg.action_dim, device=dev)
        self._warm(("actions", prefix.length, self.S), fns["actions"], _kv_only(prefix), noise)
        iso = cfg.prefix_attention == "image_isolated"
        for L in self.prompt_lens:
            for B in self.batch_sizes:
                t = torch.full((B, L), cfg.pad_id, dtype=torch.long, device=dev)
                tm = torch.zeros(B, L, dtype=torch.bool, device=dev)
                tm[:, :1] = True
                if B == 1 and ("prefill", 1, L) not in self._graphs:
                    self._warm(("prefill", 1, L), fns["prefill"], images, masks, t, tm)
                if iso:
                    img = prefix.head(cfg.num_image_tokens)
                    self._warm(("extend", B, L), fns["extend"], img, t, tm)
                elif B > 1:
                    self._warm(("prefill", B, L), fns["prefill"], images.expand(B, *images.shape[1:]),
                               masks.expand(B, C), t, tm)

    def _warm_decode(self, pool) -> None:
        dev, fns, pk = self.model.device, self._graph_fns(), self._pool_key(pool)
        if self.mode == "cudagraphs":
            for t in pool.k + pool.v:
                torch._dynamo.mark_static_address(t)
        T = self.max_context
        for B in self.batch_sizes:
            # three distinct tensors: dynamo guards on aliasing, and at run time they are distinct
            ids, pos, ws = (torch.zeros(B, dtype=torch.long, device=dev) for _ in range(3))
            rs = torch.zeros(B, T, dtype=torch.long, device=dev)
            rm = torch.zeros(B, T, dtype=torch.bool, device=dev)
            rm[:, 0] = True
            self._warm(("decode", B, T, pk), fns["decode"], ids, pos, ws, rs, rm, pool.k, pool.v,
                       static=pool.k + pool.v)
            if self.sampled_decode:
                f64 = dict(dtype=torch.float64, device=dev)
                s = SamplerInputs(torch.ones(B, **f64), torch.full((B,), 0.9, **f64), torch.full((B,), 0.5, **f64))
                self._warm(("decode_sampled", B, T, pk), fns["decode_sampled"], ids, pos, ws, rs, rm, pool.k, pool.v,
                           s, static=pool.k + pool.v)
        self._pools.add(pk)

    def _own(self, x):
        """Outputs of a CUDA graph are overwritten by its next replay: keep a copy of what outlives the call."""
        if self.mode not in GRAPH_MODES:
            return x
        if isinstance(x, Prefix):
            return Prefix([k.clone() for k in x.k], [v.clone() for v in x.v], x.mask.clone(), x.positions.clone(),
                          x.next_position.clone(), None if x.last_logits is None else x.last_logits.clone())
        if isinstance(x, tuple):
            return tuple(t.clone() for t in x)
        return x.clone()

    def _run(self, key, *args):
        g = self._graphs.get(key)
        if g is None:
            return None
        with torch.no_grad():                   # as in warmup(): grad mode is part of a graph's guards
            if self.mode == "cudagraphs":
                torch.compiler.cudagraph_mark_step_begin()
            return self._own(g(*args))

    def _eager(self, what: str):
        self.eager_calls[what] = self.eager_calls.get(what, 0) + 1

    def stats(self) -> dict:
        return {"compile": self.mode, "compile_requested": self.requested,
                "compile_s": round(self.report.compile_s, 3), "compile_graphs": len(self._graphs),
                "compile_error": self.report.error, "eager_calls": dict(self.eager_calls)}

    # ------------------------------------------------------------------ the primitives (same contract as Pi05Model)
    def prefill(self, images: Tensor, image_masks: Tensor, tokens: Tensor, token_masks: Tensor,
                want_logits: bool = False) -> Prefix:
        B, L = tokens.shape
        Bb, Lb = _bucket(B, (1,) + self.batch_sizes), _bucket(L, self.prompt_lens)   # batch 1 always has a graph
        key = ("prefill", Bb, Lb)
        if self.mode == "none" or Bb is None or Lb is None or key not in self._graphs:
            self._eager("prefill") if self.mode != "none" else None
            return self.model.prefill(images, image_masks, tokens, token_masks, want_logits)
        images = _pad_rows(images, Bb)
        image_masks = _pad_rows(image_masks.bool(), Bb, False)
        tokens = _pad_rows(_pad_cols(tokens, Lb, self.cfg.pad_id), Bb, self.cfg.pad_id)
        token_masks = _pad_rows(_pad_cols(token_masks.bool(), Lb, False), Bb, False)
        out = _rows(self._run(key, images, image_masks, tokens, token_masks), B)
        if not want_logits:
            out.last_logits = None
        return out

    def extend_prefix(self, prefix: Prefix, tokens: Tensor, token_masks: Tensor, want_logits: bool = False) -> Prefix:
        B, L = tokens.shape
        Bb, Lb = _bucket(B, self.batch_sizes), _bucket(L, self.prompt_lens)
        key = ("extend", Bb, Lb)
        if self.mode == "none" or prefix.batch_size != 1 or prefix.last_logits is not None or key not in self._graphs:
            self._eager("extend_prefix") if self.mode != "none" else None
            return self.model.extend_prefix(prefix, tokens, token_masks, want_logits)
        tokens = _pad_rows(_pad_cols(tokens, Lb, self.cfg.pad_id), Bb, self.cfg.pad_id)
        token_masks = _pad_rows(_pad_cols(token_masks.bool(), Lb, False), Bb, False)
        out = _rows(self._run(key, prefix, tokens, token_masks), B)
        if not want_logits:
            out.last_logits = None
        return out

    def sample_actions(self, prefix: Prefix, noise: Tensor, num_steps: int | None = None) -> Tensor:
        S = num_steps or self.cfg.num_denoise_steps
        key = ("actions", prefix.length, S)
        if self.mode == "none" or prefix.batch_size != 1 or noise.shape[0] != 1 or key not in self._graphs:
            self._eager("sample_actions") if self.mode != "none" else None
            return self.model.sample_actions(prefix, noise, S)
        return self._run(key, _kv_only(prefix), noise)

    def decode(self, batch: DecodeBatch, kv) -> DecodeOutput:
        B, T = batch.read_slots.shape
        Bb = _bucket(B, self.batch_sizes)
        sampler = SamplerInputs.build(batch.sampling, batch.positions)
        key = ("decode" if sampler is None else "decode_sampled", Bb, self.max_context, self._pool_key(kv))
        if self.mode == "none" or Bb is None or T > self.max_context or key not in self._graphs:
            self._eager("decode") if self.mode != "none" else None
            return self.model.decode(batch, kv)
        Tb = self.max_context
        ws = _pad_rows(batch.write_slots, Bb)
        args = [_pad_rows(batch.token_ids, Bb), _pad_rows(batch.positions, Bb), ws,
                _pad_rows(_pad_cols(batch.read_slots, Tb, batch.write_slots), Bb),
                _pad_rows(_pad_cols(batch.read_mask.bool(), Tb, False), Bb), kv.k, kv.v]
        if sampler is not None:
            args.append(SamplerInputs(_pad_rows(sampler.temperature, Bb, 0.0), _pad_rows(sampler.top_p, Bb, 1.0),
                                      _pad_rows(sampler.uniform, Bb, 0.0)))
        ids, logits = self._run(key, *args)
        return DecodeOutput(ids[:B], logits[:B])


def compile_model(model: Pi05Model, mode: str, **shape) -> "CompiledModel | Pi05Model":
    """``mode == 'none'`` -> the model itself; else a (shared) ``CompiledModel`` for these shapes, cached on the model
    so that several engines over one model (tests, the benchmark's modes) compile once."""
    if mode == "none":
        return model
    cache = model.__dict__.setdefault("_compiled", {})
    key = (mode, tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in shape.items())))
    if key not in cache:
        cache[key] = CompiledModel(model, mode, **shape)
    return cache[key]
