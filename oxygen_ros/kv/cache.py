"""KV cache ownership: `FramePrefix` (one frame's image KV, plus the action prompt's KV, stored once in the pool,
shared read-only by every request that reads that frame, reference counted, freed by the last reader), `RequestState`
(one language request: which prefix it reads and how much of it, its private prompt/generated-token KV, position,
step, finished flag, sampling state) and `KVCacheManager`, the single owner of all language-side KV memory. The manager
stores only the valid tokens of a model `Prefix` (positions kept, so masked camera slots cost nothing), decides
admission (admit / wait / reject with a reason) with block reservations so that an admitted request can never run out
of memory mid-decode, builds the `DecodeBatch` index tensors of a batched decode step (each row: its own prefix length,
position, read mask and private write slot; the shared prefix is never a write target), and frees everything when a
request finishes. `check_invariants()` verifies refcounts, slot ownership and accounting.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch

from .pool import KVPool


@dataclass(eq=False)
class FramePrefix:
    """Valid prefix tokens of one frame (or one request's own prefill), in position order, in pool slots."""
    prefix_id: int
    frame_index: int
    blocks: list
    slots: torch.Tensor          # [length] long, pool slots in position order
    positions: torch.Tensor      # [length] long, RoPE positions of the stored tokens (0..length-1)
    length: int                  # valid tokens stored
    image_length: int            # the first image_length stored tokens are image tokens
    next_position: int           # position of the first token after this prefix
    private: bool = False        # a request's own prefill (isolated / upstream), not shared
    refcount: int = 1            # the creator holds one reference until it calls release()

    def __repr__(self):
        return (f"FramePrefix(id={self.prefix_id}, frame={self.frame_index}, len={self.length}, "
                f"img={self.image_length}, refs={self.refcount}, blocks={len(self.blocks)})")


@dataclass(eq=False)
class RequestState:
    """A language request being decoded. Its last produced token (`last_token`) is not yet in the cache: the next
    decode step writes its K/V at position `next_position` and produces the following token."""
    request: object              # engine.requests.LanguageRequest
    prefix: FramePrefix
    shared_len: int              # how many of prefix.slots this request reads (all, or the image part only)
    base_position: int           # RoPE position of private token 0
    max_new_tokens: int
    eos_token_id: Optional[int]
    sampling: object = None      # model SamplingParams or None (greedy)
    frame_index: int = -1
    blocks: list = field(default_factory=list)
    slots: torch.Tensor = None   # [len(blocks) * block_size] long, private slots
    prompt_len: int = 0          # private prompt tokens (image_isolated prompts other than the action prompt)
    private_len: int = 0         # private tokens whose K/V is written (prompt + generated)
    reserved_blocks: int = 0     # blocks promised to this request and not yet allocated
    generated: list = field(default_factory=list)
    finished: bool = False
    finish_reason: str = ""
    t_admit: float = 0.0
    t_first_token: float = 0.0
    t_finish: float = 0.0
    tokens_this_cycle: int = 0

    @property
    def request_id(self) -> int:
        return self.request.request_id

    @property
    def last_token(self) -> int:
        return self.generated[-1]

    @property
    def next_position(self) -> int:
        return self.base_position + self.private_len

    @property
    def read_len(self) -> int:
        return self.shared_len + self.private_len

    @property
    def tokens_left(self) -> int:
        return 0 if self.finished else self.max_new_tokens - len(self.generated)


@dataclass
class DecodePlan:
    """Index tensors for up to K = `max(steps)` batched decode steps over `rows`, built once per cycle: every step's
    positions, write slots and read mask are computed here in three batched ops, so a step whose rows are the
    plan's rows only takes views (no tensor work on the host between the model calls)."""
    rows: list
    steps: list                  # decode steps planned per row this cycle
    read_slots: torch.Tensor     # [B, T] long: shared prefix slots then private slots, position order, padded
    base_len: torch.Tensor       # [B] long: tokens readable before this cycle's first write
    base_pos: torch.Tensor       # [B] long: position of each row's first write this cycle
    active: list = None          # row indices still decoding (shrinks as rows finish)
    active_idx: torch.Tensor = None
    step: int = 0
    positions: torch.Tensor = None   # [K, B] long: position of the token written at step i
    write_slots: torch.Tensor = None  # [K, B] long: its slot
    read_mask: torch.Tensor = None   # [K, B, T] bool: the slots readable at step i (incl. the one written)


class KVCacheManager:
    def __init__(self, pool: KVPool, *, max_batch: int = 16):
        self.pool = pool
        self.max_batch = int(max_batch)
        self.prefixes: dict[int, FramePrefix] = {}
        self.requests: dict[int, RequestState] = {}
        self.reserved_blocks = 0
        self.peak_live_tokens = 0
        self._ids = itertools.count()
        self._arange_cache = torch.arange(0, dtype=torch.long, device=pool.device)

    # ------------------------------------------------------------------ accounting
    @property
    def available_blocks(self) -> int:
        """Free blocks not promised to admitted requests."""
        return self.pool.free_blocks - self.reserved_blocks

    @property
    def live_tokens(self) -> int:
        """Tokens actually held: stored prefix tokens + written private tokens."""
        return sum(p.length for p in self.prefixes.values()) + sum(r.private_len for r in self.requests.values())

    @property
    def num_active(self) -> int:
        return len(self.requests)

    def _note_live(self):
        lt = self.live_tokens
        if lt > self.peak_live_tokens:
            self.peak_live_tokens = lt

    def reset_peak(self):
        self.pool.reset_peak()
        self.peak_live_tokens = self.live_tokens

    def stats(self) -> dict:
        p = self.pool
        return {
            "kv_bytes_in_use": p.used_bytes, "kv_bytes_peak": p.peak_bytes, "kv_bytes_capacity": p.capacity_bytes,
            "kv_tokens_in_use": p.used_tokens, "kv_tokens_peak": p.peak_tokens, "kv_tokens_capacity": p.capacity_tokens,
            "kv_live_tokens": self.live_tokens, "kv_live_tokens_peak": self.peak_live_tokens,
            "kv_live_bytes": self.live_tokens * p.bytes_per_token,
            "kv_blocks_reserved": self.reserved_blocks, "kv_prefixes": len(self.prefixes),
            "kv_active_requests": len(self.requests),
        }

    # ------------------------------------------------------------------ frame prefixes
    @torch.no_grad()
    def store_prefix(self, prefix, row: int = 0, *, frame_index: int, stop: int | None = None,
                     image_positions: int = 0, private: bool = False) -> FramePrefix:
        """Copy the valid tokens of `prefix` row `row` (dense positions [0, stop)) into pool slots. `image_positions`
        is how many leading dense positions are image tokens. The caller holds one reference (release() it)."""
        mask = prefix.mask[row, :stop]
        idx = mask.nonzero().squeeze(1)
        n = int(idx.numel())
        n_img = int(mask[:image_positions].sum()) if image_positions else 0
        pos = prefix.positions[row, :stop].index_select(0, idx).to(self.pool.device)
        blocks = self.pool.allocate(self.pool.blocks_for(n))
        try:
            slots = self.pool.slots(blocks, n)
            self.pool.write(slots, [k[row].index_select(0, idx) for k in prefix.k],
                            [v[row].index_select(0, idx) for v in prefix.v])
        except BaseException:
            self.pool.free(blocks)
            raise
        next_pos = int(pos[-1]) + 1 if n else 0
        fp = FramePrefix(next(self._ids), frame_index, blocks, slots, pos, n, n_img, next_pos, private=private)
        self.prefixes[fp.prefix_id] = fp
        self._note_live()
        return fp

    def retain(self, fp: FramePrefix) -> None:
        if fp.refcount <= 0:
            raise RuntimeError(f"retain of freed prefix {fp}")
        fp.refcount += 1

    def release(self, fp: FramePrefix) -> None:
        if fp.refcount <= 0:
            raise RuntimeError(f"release of freed prefix {fp}")
        fp.refcount -= 1
        if fp.refcount == 0:
            self.pool.free(fp.blocks)
            fp.blocks = []
            del self.prefixes[fp.prefix_id]

    # ------------------------------------------------------------------ admission
    def request_blocks(self, private_prompt_tokens: int, max_new_tokens: int) -> int:
        """Private blocks a request needs over its life: its own prompt tokens + (max_new - 1) written tokens
        (the last produced token is never written)."""
        return self.pool.blocks_for(private_prompt_tokens + max(0, max_new_tokens - 1))

    def plan_admission(self, needs: list, shared_prefix_blocks: int = 0) -> list:
        """FIFO admission decision for candidates needing `needs[i]` blocks each (their own prefixes included when
        they have one), plus `shared_prefix_blocks` once if at least one is admitted (the frame prefix).
        Returns per candidate None (admit), ("wait", reason) or ("reject", reason). No overtaking: after the first
        waiting candidate all later ones wait too."""
        avail, rows, paid, blocked, out = self.available_blocks, len(self.requests), False, False, []
        for need in needs:
            total = need + (0 if paid else shared_prefix_blocks)
            if need + shared_prefix_blocks > self.pool.num_blocks:
                out.append(("reject", f"too_large: needs {need + shared_prefix_blocks} blocks, "
                                      f"pool has {self.pool.num_blocks}"))
                continue
            if blocked:
                out.append(("wait", "queued_behind"))
            elif rows >= self.max_batch:
                out.append(("wait", "batch_full"))
                blocked = True
            elif total > avail:
                out.append(("wait", "kv_full"))
                blocked = True
            else:
                avail -= total
                rows += 1
                paid = True
                out.append(None)
        return out

    @torch.no_grad()
    def admit(self, request, prefix: FramePrefix, *, shared_len: int, first_token: int, max_new_tokens: int,
              eos_token_id: Optional[int], sampling=None, frame_index: int = -1, private_prompt=None,
              now: float = 0.0) -> RequestState:
        """Bind a request to `prefix` (takes a reference) and give it its private blocks. `private_prompt` =
        (Prefix, row, start): dense positions >= start of that row are the request's own prompt tokens (their valid
        ones are copied into its private slots). `first_token` is the token chosen from the last valid prefix
        position's logits; it is the request's output token 0."""
        if len(self.requests) >= self.max_batch:
            raise RuntimeError("admit beyond max_batch (plan_admission first)")
        n_prompt, idx = 0, None
        if private_prompt is not None:
            pp, prow, start = private_prompt
            idx = pp.mask[prow, start:].nonzero().squeeze(1) + start
            n_prompt = int(idx.numel())
        total = self.request_blocks(n_prompt, max_new_tokens)
        if total > self.available_blocks:
            raise RuntimeError("admit without capacity (plan_admission first)")
        now_blocks = self.pool.blocks_for(n_prompt)
        blocks = self.pool.allocate(now_blocks)
        if shared_len == prefix.length:
            base = prefix.next_position
        else:
            base = int(prefix.positions[shared_len - 1]) + 1 if shared_len else 0
        st = RequestState(request, prefix, shared_len, base, max_new_tokens, eos_token_id, sampling, frame_index,
                          blocks, self.pool.slots(blocks), n_prompt, 0, total - now_blocks)
        try:
            if n_prompt:
                pos = pp.positions[prow].index_select(0, idx)
                if int(pos[0]) != st.base_position or int(pos[-1]) != st.base_position + n_prompt - 1:
                    raise RuntimeError("private prompt positions do not continue the shared prefix")
                self.pool.write(st.slots[:n_prompt], [k[prow].index_select(0, idx) for k in pp.k],
                                [v[prow].index_select(0, idx) for v in pp.v])
                st.private_len = n_prompt
        except BaseException:
            self.pool.free(blocks)
            raise
        self.retain(prefix)
        self.reserved_blocks += st.reserved_blocks
        st.generated.append(int(first_token))
        st.tokens_this_cycle = 1
        st.t_admit = st.t_first_token = now
        self.requests[request.request_id] = st
        self._note_live()
        return st

    def finish(self, st: RequestState, reason: str, now: float = 0.0) -> None:
        """Free a request's private blocks and reservation and drop its prefix reference. Idempotent."""
        if st.request_id not in self.requests:
            return
        st.finished, st.t_finish = True, now
        if not st.finish_reason:
            st.finish_reason = reason
        del self.requests[st.request_id]
        self.pool.free(st.blocks)
        st.blocks = []
        st.slots = st.slots[:0]
        self.reserved_blocks -= st.reserved_blocks
        st.reserved_blocks = 0
        self.release(st.prefix)

    def check_finished(self, st: RequestState) -> Optional[str]:
        """Finish reason implied by the last produced token, or None."""
        if st.eos_token_id is not None and st.generated[-1] == st.eos_token_id:
            return "eos"
        if len(st.generated) >= st.max_new_tokens:
            return "length"
        return None

    def trim(self, st: RequestState) -> None:
        """Give back blocks beyond what the written tokens need (to the request's reservation), e.g. after a
        cycle failed part way."""
        keep = self.pool.blocks_for(st.private_len)
        if len(st.blocks) > keep:
            extra = st.blocks[keep:]
            st.blocks = st.blocks[:keep]
            st.slots = st.slots[:keep * self.pool.block_size]
            self.pool.free(extra)
            st.reserved_blocks += len(extra)
            self.reserved_blocks += len(extra)

    # ------------------------------------------------------------------ decode batches
    def begin_cycle(self) -> None:
        """Start of a frame: no request has produced a token in it yet."""
        for st in self.requests.values():
            st.tokens_this_cycle = 0

    def _ensure_private(self, st: RequestState, n_tokens: int) -> None:
        need = self.pool.blocks_for(n_tokens) - len(st.blocks)
        if need <= 0:
            return
        if need > st.reserved_blocks:
            raise RuntimeError(f"request {st.request_id} exceeds its reservation")
        new = self.pool.allocate(need)
        st.reserved_blocks -= need
        self.reserved_blocks -= need
        st.blocks.extend(new)
        st.slots = torch.cat([st.slots, self.pool.slots(new)])

    def plan_decode(self, rows: list, steps: list) -> DecodePlan:
        """Allocate the private slots that `steps[i]` decode steps of row i will write, and build the per-row read
        index (shared prefix slots, then private slots, in position order)."""
        assert len(rows) == len(steps) and all(s >= 1 for s in steps)
        dev = self.pool.device
        lens, reads = [], []
        for st, s in zip(rows, steps):
            if st.finished or s > st.tokens_left:
                raise RuntimeError(f"request {st.request_id}: {s} steps planned, {st.tokens_left} tokens left")
            self._ensure_private(st, st.private_len + s)
            reads.append((st.prefix.slots[:st.shared_len], st.slots[:st.private_len + s]))
            lens.append(st.read_len)
        T = max(l + s for l, s in zip(lens, steps))
        read = torch.zeros((len(rows), T), dtype=torch.long, device=dev)
        for i, (a, b) in enumerate(reads):
            read[i, :a.numel()] = a
            read[i, a.numel():a.numel() + b.numel()] = b
        base_len = torch.tensor(lens, dtype=torch.long, device=dev)
        base_pos = torch.tensor([st.next_position for st in rows], dtype=torch.long, device=dev)
        K = max(steps)
        if self._arange_cache.numel() < max(T, K):
            self._arange_cache = torch.arange(max(T, K, 2 * self._arange_cache.numel()), dtype=torch.long, device=dev)
        ar = self._arange_cache
        n = base_len[None, :] + ar[:K, None] + 1            # [K, B] tokens readable at step i incl. the written one
        positions = base_pos[None, :] + ar[:K, None]        # [K, B]
        write = read.gather(1, (n - 1).clamp(max=T - 1).t()).t().contiguous()   # clamp: steps past a row's plan
        mask = ar[:T][None, None, :] < n[:, :, None]        # [K, B, T]
        active = list(range(len(rows)))
        return DecodePlan(rows, list(steps), read, base_len, base_pos, active,
                          torch.arange(len(rows), dtype=torch.long, device=dev), 0, positions, write, mask)

    def step_tensors(self, plan: DecodePlan):
        """(positions, write_slots, read_slots, read_mask) for the plan's current step over its active rows: views
        of the plan's tensors while every row is active, row selections once some have left."""
        i = plan.step
        pos, write, mask, read = plan.positions[i], plan.write_slots[i], plan.read_mask[i], plan.read_slots
        if len(plan.active) == len(plan.rows):
            return pos, write, read, mask
        idx = plan.active_idx
        sel = lambda t: t.index_select(0, idx)  # noqa: E731
        return sel(pos), sel(write), sel(read), sel(mask)

    def commit_step(self, plan: DecodePlan, next_ids: list, now: float = 0.0) -> list:
        """Record one decode step's results for the plan's active rows (in order). Returns [(state, token, reason)]
        with reason None while the request continues. Finished requests are freed here; rows whose planned steps are
        used up leave the active set."""
        out, keep = [], []
        for r, tok in zip(plan.active, next_ids):
            st = plan.rows[r]
            st.private_len += 1                                   # the previous token's K/V is now written
            st.generated.append(int(tok))
            st.tokens_this_cycle += 1             # tokens produced in this frame (admission sets 1 for token 0)
            reason = self.check_finished(st)
            out.append((st, int(tok), reason))
            if reason is not None:
                self.finish(st, reason, now)
            elif plan.steps[r] > plan.step + 1:
                keep.append(r)
        self._note_live()
        plan.step += 1
        if keep != plan.active:
            plan.active = keep
            plan.active_idx = torch.tensor(keep, dtype=torch.long, device=self.pool.device)
        return out

    # ------------------------------------------------------------------ invariants
    def check_invariants(self, idle: bool = False) -> None:
        """Raise AssertionError on any inconsistency. `idle=True` (between cycles): every stored prefix is held
        exactly by its readers (no creator reference left over)."""
        self.pool.check_invariants()
        owner: dict[int, str] = {}
        for p in self.prefixes.values():
            for b in p.blocks:
                if b in owner:
                    raise AssertionError(f"block {b} owned by {owner[b]} and prefix {p.prefix_id}")
                owner[b] = f"prefix {p.prefix_id}"
            if p.length > len(p.blocks) * self.pool.block_size:
                raise AssertionError(f"prefix {p.prefix_id} longer than its blocks")
        refs: dict[int, int] = {}
        reserved = 0
        for r in self.requests.values():
            if r.finished:
                raise AssertionError(f"finished request {r.request_id} still active")
            for b in r.blocks:
                if b in owner:
                    raise AssertionError(f"block {b} owned by {owner[b]} and request {r.request_id}")
                owner[b] = f"request {r.request_id}"
            if r.private_len > len(r.blocks) * self.pool.block_size:
                raise AssertionError(f"request {r.request_id} wrote past its blocks")
            if r.prefix.prefix_id not in self.prefixes:
                raise AssertionError(f"request {r.request_id} reads a freed prefix")
            if r.shared_len > r.prefix.length:
                raise AssertionError(f"request {r.request_id} reads past its prefix")
            refs[r.prefix.prefix_id] = refs.get(r.prefix.prefix_id, 0) + 1
            reserved += r.reserved_blocks
            if r.reserved_blocks < 0:
                raise AssertionError("negative reservation")
        for p in self.prefixes.values():
            readers = refs.get(p.prefix_id, 0)
            if idle and p.refcount != readers:
                raise AssertionError(f"prefix {p.prefix_id} refcount {p.refcount} != readers {readers} between cycles")
            if p.refcount < readers or p.refcount < 1:
                raise AssertionError(f"prefix {p.prefix_id} refcount {p.refcount} < readers {refs.get(p.prefix_id, 0)}")
        if reserved != self.reserved_blocks:
            raise AssertionError(f"reservation mismatch {reserved} != {self.reserved_blocks}")
        if reserved > self.pool.free_blocks:
            raise AssertionError("more blocks reserved than free")
        for b in owner:
            if not self.pool.is_allocated(b):
                raise AssertionError(f"owned block {b} is free in the pool")
        if len(owner) != self.pool.used_blocks:
            raise AssertionError(f"{self.pool.used_blocks - len(owner)} allocated blocks have no owner (leak)")
