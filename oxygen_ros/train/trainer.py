"""The training loop: data -> model -> optimiser -> checkpoints the node loads, resumable and distributed.

This file owns a run.  ``Trainer(options, layout)`` (``layout``: the robot's ``data.RobotLayout``, which the caller
reads from the node's parameter file) loads the episodes (``data.py``), splits off validation episodes,
computes the norm stats (or takes them from ``--init``), trains the domain tokenizer (``tokenizer.py``), builds the
model (``model/pi05.py`` from a preset with the data's horizon and vocabulary, or ``--init`` weights) and runs
``options.steps`` AdamW steps with linear warm-up + cosine decay, gradient clipping, optional bf16 autocast, the
losses of ``losses.py`` and batches of ``batches.py``.  Determinism: one seeded numpy generator picks every global
batch (rows, text targets) and one seeded torch generator draws every noise, time and augmentation; both are part of
the checkpoint, so ``--resume`` continues exactly where an uninterrupted run would be.  Under ``torchrun`` each rank
takes its slice of the same global batch and DDP (gloo on CPU, NCCL on CUDA) averages the gradients, so N processes
compute the update one process computes on the whole batch.  ``device`` (``device.py``): ``auto`` = CUDA when
present (under torchrun ``cuda:LOCAL_RANK``), else the CPU; the model, optimiser state and every batch live there
(batches are assembled on the host, pinned and copied without blocking), noise and times are still drawn on the
host's generators (the same numbers on any device), bf16 autocast runs on the device's type, and DDP picks NCCL only
when the tensors are on CUDA (``ddp_backend``).  Every ``ckpt_every`` steps (and at the end) rank 0
writes ``checkpoints/step_NNNNNN/`` - ``model.safetensors`` + ``config.json`` + ``assets/<asset_id>/norm_stats.json``
+ ``paligemma_tokenizer.model`` (what ``load_checkpoint`` / the node's ``checkpoint`` parameter read) plus
``train_state.safetensors`` / ``train_state.json`` (optimiser moments, step, generators, options) - into a temporary
folder renamed when complete, then points ``latest`` at it; Ctrl-C leaves the last complete checkpoint.  Curves
(train / validation loss, learning rate) go to ``curves.json`` and ``curves.png``; ``eval_hook(step, ckpt)`` (e.g. a
few closed-loop episodes) runs every ``eval_every`` steps when given.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from .device import ddp_backend, resolve_device
from .focus import GROUPS
from .precision import resolve_bf16
from .run_files import flatten_optimizer, plot_curves, restore_optimizer

__all__ = ["TrainOptions", "Trainer", "lr_at"]


@dataclass
class TrainOptions:
    bags: list
    out: str
    params: str | None = None              # node parameter file the caller read the RobotLayout from (recorded)
    preset: str = "demo"
    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup: int = 200
    weight_decay: float = 1e-4
    grad_clip: float = 1.0
    text_weight: float = 0.5
    bf16: bool | str = False               # bf16 autocast: True / "on", False / "off", "auto" (resolve_bf16)
    compile: bool = False                  # torch.compile the training step (inductor; minutes to build, then faster)
    augment: bool = False
    seed: int = 0
    val_fraction: float = 0.05
    val_every: int = 500
    val_batches: int = 4
    ckpt_every: int = 1000
    log_every: int = 20
    vocab_size: int = 1024
    horizon: int | None = None             # default: the preset's
    asset_id: str = "sim_aloha"
    threads: int = 0                       # torch threads; 0 = torch's default
    device: str = "auto"                   # auto (cuda if available, else cpu) | cpu | cuda | cuda:N
    init: str | None = None                # checkpoint to start from (fine-tuning)
    init_vision: str | None = None         # a pretrained vision tower (``vision.py``) for a model built from scratch
    resume: bool = False                   # continue the run in ``out`` from its latest checkpoint
    eval_every: int = 0
    locate_in_instruction: bool = False    # experiment: the named cube's cell appended to each frame's instruction
    state_noise: float = 0.0               # experiment: noise (rad) on the arms' state in the prompt (batches.py)
    state_input: bool = True               # False: no state in the action prompt (openpi's discrete_state_input)
    focus: dict = field(default_factory=dict)    # {"start": w, "grasp": w}: those frames drawn w x as often (focus.py)
    target_weight: float = 0.0             # > 0: the auxiliary target (target_aux.py: the expert regresses the cube)
    target_within: float | None = None     # the auxiliary target only in each episode's first seconds
    plan_weight: float = 0.0               # > 0: the plan's grip sites vs the label's (plan_target.py)
    topics: dict = field(default_factory=dict)   # --*-topic overrides (TopicMap fields)
    model_overrides: dict = field(default_factory=dict)   # config fields over the preset's (tests: small images)
    quiet: bool = False


def lr_at(step: int, o: TrainOptions) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to ``lr * min_lr_ratio`` at ``steps``."""
    if step < o.warmup:
        return o.lr * (step + 1) / max(1, o.warmup)
    p = min(1.0, (step - o.warmup) / max(1, o.steps - o.warmup))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


class _Step(torch.nn.Module):
    """What DDP wraps: the model's training forward, plus the auxiliary target head when there is one (so that DDP
    averages its gradients too): then it returns (velocity, logits, the head's prediction)."""

    def __init__(self, model, target_head=None):
        super().__init__()
        self.model = model
        self.target_head = target_head

    def forward(self, *args):
        if self.target_head is None:
            return self.model.forward_train(*args)
        v, logits, h = self.model.forward_train(*args, return_hidden=True)
        return v, logits, self.target_head(h)


class Trainer:
    def __init__(self, o: TrainOptions, layout, eval_hook=None, log=None):
        self.o = o
        self.layout = layout           # data.RobotLayout: cameras, joint names, delta_action_mask, memory prompt
        self.eval_hook = eval_hook
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        if o.batch_size % self.world:
            raise ValueError(f"batch size {o.batch_size} is not divisible by the {self.world} processes")
        self.out = Path(o.out)

    # ------------------------------------------------------------------------------------------------ setup
    def _say(self, s: str) -> None:
        if self.rank == 0 and not self.o.quiet:
            self.log(s)

    def setup(self) -> None:
        from oxygen_ros.model import NormStats, Processor, get_config, load_checkpoint  # noqa: PLC0415
        from oxygen_ros.model.checkpoint import CheckpointError  # noqa: PLC0415
        from oxygen_ros.model.pi05 import Pi05Model  # noqa: PLC0415
        from oxygen_ros.model.tokenizer import SPM_FILENAME, SentencePieceTokenizer  # noqa: PLC0415

        from .batches import BatchMaker  # noqa: PLC0415
        from .data import (TopicMap, describe, load_episodes, locate_in_instructions, norm_stats,  # noqa: PLC0415
                           split_episodes)
        from .focus import column_ranges, describe_groups, frame_groups, sampling_probabilities  # noqa: PLC0415
        from .tokenizer import domain_lines, train_tokenizer  # noqa: PLC0415

        o = self.o
        if o.threads > 0:
            torch.set_num_threads(o.threads)
        self.device = dev = resolve_device(o.device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        self.bf16 = resolve_bf16(o.bf16, dev)
        if self.world > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group(ddp_backend(dev))
        layout = self.layout
        self.delta_mask = np.zeros(len(layout.action_names), bool)
        dm = np.asarray(layout.delta_action_mask, bool)
        self.delta_mask[:len(dm)] = dm
        resume_dir = self._latest() if o.resume else None
        if o.resume and resume_dir is None:
            raise ValueError(f"--resume: no checkpoint in {self.out / 'checkpoints'}")
        init_dir = resume_dir or (Path(o.init) if o.init else None)
        # the model's shape decides the image size the data is decoded at
        if init_dir is not None:
            try:
                pol = load_checkpoint(init_dir)
            except CheckpointError as exc:
                raise ValueError(f"cannot load {init_dir}: {exc}") from exc
            cfg = pol.cfg
            if not resume_dir and o.preset and o.preset != cfg.name:
                want = get_config(o.preset)
                if (want.vision, want.vlm, want.expert) != (cfg.vision, cfg.vlm, cfg.expert):
                    raise ValueError(f"--init {init_dir}: its architecture ({cfg.name}) is not the preset "
                                     f"{o.preset!r}'s; drop --preset or pick the matching one")
            if o.horizon and o.horizon != cfg.action_horizon:
                if resume_dir:
                    raise ValueError(f"--resume: this run plans {cfg.action_horizon} rows, not --horizon "
                                     f"{o.horizon}; resume with the run's horizon, or start a new run with --init")
                # no weight depends on H (the noise's rows are the action tokens): a longer plan is a fine-tune
                self._say(f"horizon: {cfg.action_horizon} -> {o.horizon} rows (norm stats recomputed for it)")
                cfg = cfg.replace(action_horizon=int(o.horizon))
                pol = pol._replace(norm_stats=None)
            if not o.state_input and not resume_dir:
                cfg = cfg.replace(discrete_state_input=False)
            elif o.state_input and not cfg.discrete_state_input:
                raise ValueError(f"{init_dir} was trained without the state in its action prompt; "
                                 "keep --no-state-input (a prompt it never saw would follow)")
        else:
            over = dict(o.model_overrides)
            if o.horizon:
                over["action_horizon"] = o.horizon
            if not o.state_input:
                over["discrete_state_input"] = False
            cfg = get_config(o.preset, **over)
        tm = TopicMap.from_layout(layout, **o.topics)
        t0 = time.perf_counter()
        episodes = load_episodes(o.bags, tm, image_size=cfg.image_size)
        self._say(f"data: {describe(episodes)} ({time.perf_counter() - t0:.0f} s to read)")
        if o.locate_in_instruction:
            n = locate_in_instructions(episodes)
            if n == 0:
                raise ValueError("--locate-in-instruction: no frame has a 'Where is the <named> cube?' text target")
            self._say(f"locate in instruction: {n} frames' instructions name their cube's cell")
        if o.target_weight > 0:
            from .target_aux import attach_targets  # noqa: PLC0415
            n = attach_targets(episodes, o.target_within)
            if n == 0:
                raise ValueError("--target-weight: no frame has a named cube with a known place (bags of oxygen "
                                 "sim-record carry the task draw and the 'Where is the <colour> cube?' targets)")
            self._say(f"auxiliary target: {n} of {sum(e.num_frames for e in episodes)} frames know the named cube's "
                      f"place (weight {o.target_weight}"
                      f"{'' if o.target_within is None else f', first {o.target_within:g} s only'})")
        if len(tm.action_names) > cfg.action_dim:
            raise ValueError(f"{len(tm.action_names)} action joints exceed the model's action_dim {cfg.action_dim}")
        self.train_eps, self.val_eps = split_episodes(episodes, o.val_fraction, o.seed)
        if init_dir is not None:
            ns = pol.norm_stats
            if ns is None:
                ns = NormStats.from_dict(norm_stats(self.train_eps, cfg.action_horizon, self.delta_mask))
            tok = pol.tokenizer
            model = pol.model
            model.cfg = cfg                    # what save_checkpoint writes (--no-state-input may have changed it)
            self.tok_path = init_dir / SPM_FILENAME if (init_dir / SPM_FILENAME).is_file() else None
        else:
            ns = NormStats.from_dict(norm_stats(self.train_eps, cfg.action_horizon, self.delta_mask))
            self.tok_path = self.out / "tokenizer" / SPM_FILENAME
            if self.rank == 0:
                train_tokenizer(domain_lines(self.train_eps, ns.to_dict(), layout.memory_prompt), self.tok_path,
                                o.vocab_size)
            if self.world > 1:
                torch.distributed.barrier()
            tok = SentencePieceTokenizer(self.tok_path)
            cfg = cfg.replace(vocab_size=max(cfg.vocab_size, tok.vocab_size) if cfg.vocab_size < 100_000
                              else cfg.vocab_size)
            torch.manual_seed(o.seed)
            model = Pi05Model(cfg)
            if o.init_vision:
                from .vision import load_vision  # noqa: PLC0415
                load_vision(model, o.init_vision)
                self._say(f"vision tower from {o.init_vision}")
        self.cfg, self.norm_stats, self.tok = cfg, ns, tok
        model = model.to(dev)
        model.requires_grad_(True)
        model.paligemma_with_expert.gemma_expert.lm_head.requires_grad_(False)      # unused (openpi key only)
        model.train()
        self.model = model
        self.target_head = None
        if o.target_weight > 0:
            from .target_aux import TargetHead  # noqa: PLC0415
            torch.manual_seed(o.seed + 3)
            self.target_head = TargetHead(cfg.expert.width).to(dev).train()
        self.plan = None
        if o.plan_weight > 0:
            from .plan_target import PlanTarget  # noqa: PLC0415
            self.plan = PlanTarget(ns, self.delta_mask)
        self.proc = Processor(cfg, tok, ns, action_dims=len(tm.action_names))
        self.maker = BatchMaker(cfg, self.proc, self.delta_mask, 0)
        self.maker.text_len = int(math.ceil(self.maker.longest_text(episodes) / 8) * 8)
        self.samples = [(e, f) for e in self.train_eps for f in range(e.num_frames)]
        if not self.samples:
            raise ValueError("the training split holds no frames")
        # the frames vision decides (focus.py): drawn more often with --focus, reported apart in validation
        A = len(tm.action_names)
        absolute = ~self.delta_mask[:A]
        ranges = column_ranges(self.train_eps, absolute)
        groups = lambda eps: (np.concatenate([frame_groups(e, cfg.action_horizon, absolute, ranges)  # noqa: E731
                                              for e in eps]) if eps else np.zeros(0, object))
        train_groups = groups(self.train_eps)
        self.draw_p = sampling_probabilities(train_groups, o.focus)
        self._say(f"frames: {describe_groups(train_groups, self.draw_p)}")
        self._val_groups = groups(self.val_eps)
        params = [p for p in model.parameters() if p.requires_grad]
        if self.target_head is not None:
            params += list(self.target_head.parameters())
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=o.lr, betas=(0.9, 0.95),
                                     eps=1e-8)
        self.step_fn = self._plain_step = _Step(model, self.target_head)
        if self.world > 1:
            # not synchronised (DDP broadcasts every parameter and buffer at start): the unused expert lm_head (a
            # zero-stride view, the same on every rank) and SigLIP's constant position-id buffer (expanded)
            DDP = torch.nn.parallel.DistributedDataParallel
            DDP._set_params_and_buffers_to_ignore_for_model(self.step_fn, [
                n for n, t in list(self.step_fn.named_parameters()) + list(self.step_fn.named_buffers())
                if t.stride() and 0 in t.stride()])
            self.step_fn = DDP(self.step_fn, device_ids=[dev.index] if dev.type == "cuda" else None)
        if o.compile:
            self.step_fn = torch.compile(self.step_fn)
        self.rng = np.random.default_rng(o.seed)
        self.gen = torch.Generator().manual_seed(o.seed)
        self.step = 0
        self.curves: dict = {"train": [], "val": [], "eval": []}
        if resume_dir is not None:
            self._load_state(resume_dir)
            self._say(f"resumed from {resume_dir} at step {self.step}")
        n_par = sum(p.numel() for p in params)
        self._say(f"model: {cfg.name} {n_par / 1e6:.2f} M trainable parameters, H={cfg.action_horizon}, "
                  f"vocab {tok.vocab_size}, image {cfg.image_size} px, text_len {self.maker.text_len}; "
                  f"{len(self.samples)} training frames, {sum(e.num_frames for e in self.val_eps)} validation frames; "
                  f"world {self.world}, device {dev}{', bf16' if self.bf16 else ', fp32'}")
        self._val_items = self._fixed_val_items()
        self._val_group_items = {g: self._fixed_val_items(g) for g in GROUPS}

    # ------------------------------------------------------------------------------------------------ batches
    def _global_items(self) -> list:
        """The next global batch (same on every rank): rows and text-target choices from the shared generator."""
        if self.draw_p is None:
            idx = self.rng.integers(0, len(self.samples), size=self.o.batch_size)
        else:
            idx = self.rng.choice(len(self.samples), size=self.o.batch_size, p=self.draw_p)
        choice = self.rng.integers(0, 1 << 30, size=self.o.batch_size)
        return [(self.samples[i][0], self.samples[i][1], int(c)) for i, c in zip(idx, choice)]

    def _fixed_val_items(self, group: str | None = None) -> list:
        """A fixed sample of validation frames (of one focus group when ``group`` is given)."""
        if not self.val_eps:
            return []
        r = np.random.default_rng(self.o.seed + 1)
        val = [(e, f) for e in self.val_eps for f in range(e.num_frames)]
        if group is not None:
            val = [v for v, g in zip(val, self._val_groups) if g == group]
        n = min(len(val), self.o.val_batches * self.o.batch_size)
        return [(val[i][0], val[i][1], int(r.integers(1 << 30))) for i in r.permutation(len(val))[:n]]

    # ------------------------------------------------------------------------------------------------ loop
    def train(self, until: int | None = None) -> dict:
        """Run to ``steps`` (or stop after step ``until``, as an interruption would: resumable)."""
        from .losses import loss_counts, pi05_loss, sample_time  # noqa: PLC0415

        o = self.o
        B, per = o.batch_size, o.batch_size // self.world
        H, A = self.cfg.action_horizon, self.cfg.action_dim
        stop = {"flag": False}
        old = signal.getsignal(signal.SIGINT)

        def on_sigint(signum, frame):           # finish the step, keep the last complete checkpoint, stop
            # no print here: a handler runs between two bytecodes of the main thread, possibly inside its own print
            # (stdout's lock held), where a print raises "reentrant call" out of the training step
            if stop["flag"]:
                raise KeyboardInterrupt
            stop["flag"] = True
        if self.rank == 0:
            signal.signal(signal.SIGINT, on_sigint)
        t_start, seen = time.perf_counter(), 0
        acc = {"loss": 0.0, "fm": 0.0, "ce": 0.0, "target": 0.0, "plan": 0.0, "n": 0}
        if self._val_items and o.init and self.step == 0 and not self.curves["val"]:
            self._validate_and_log()            # a fine-tune's curve starts at its init's losses
        try:
            while self.step < min(o.steps, until or o.steps) and not stop["flag"]:
                items = self._global_items()
                noise = torch.randn(B, H, A, generator=self.gen)
                tt = sample_time(B, self.gen)
                aug_seed = int(torch.randint(0, 1 << 62, (1,), generator=self.gen))
                lo, hi = self.rank * per, (self.rank + 1) * per
                batch = self.maker.make(items[lo:hi], torch.Generator().manual_seed(aug_seed + self.rank),
                                        augment=o.augment, state_noise=o.state_noise).to(self.device)
                lr = lr_at(self.step, o)
                for g in self.opt.param_groups:
                    g["lr"] = lr
                counts = loss_counts(batch).to(self.device)
                if self.world > 1:                    # global denominators: DDP's mean of rank gradients = global
                    torch.distributed.all_reduce(counts)
                denoms = counts.clamp(min=1.0) / self.world
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                    loss, fm, ce, tl, pl = pi05_loss(self.step_fn, batch, noise[lo:hi].to(self.device),
                                                     tt[lo:hi].to(self.device), o.text_weight, denoms,
                                                     o.target_weight, self.plan, o.plan_weight)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                gnorm = torch.nn.utils.clip_grad_norm_(params_of(self.model, self.target_head), o.grad_clip)
                self.opt.step()
                self.step += 1
                seen += 1
                for k, v in (("loss", loss.detach()), ("fm", fm), ("ce", ce), ("target", tl), ("plan", pl)):
                    acc[k] += float(v) * self.world      # this rank's share of the global mean
                acc["n"] += 1
                if self.step % o.log_every == 0 or self.step == o.steps:
                    n = max(1, acc["n"])
                    rate = seen / (time.perf_counter() - t_start)
                    rec = {"step": self.step, "loss": acc["loss"] / n, "fm": acc["fm"] / n, "ce": acc["ce"] / n,
                           "lr": lr, "grad_norm": float(gnorm), "steps_per_s": rate}
                    if self.target_head is not None:
                        rec["target"] = acc["target"] / n
                    if self.plan is not None:
                        rec["plan"] = acc["plan"] / n
                    self.curves["train"].append(rec)
                    eta = (o.steps - self.step) / rate if rate > 0 else 0
                    self._say(f"step {self.step}/{o.steps}  loss {rec['loss']:.4f} (flow {rec['fm']:.4f}, text "
                              f"{rec['ce']:.4f}{', target %.4f' % rec['target'] if 'target' in rec else ''}"
                              f"{', plan %.4f' % rec['plan'] if 'plan' in rec else ''})  "
                              f"lr {lr:.2e}  {rate:.2f} steps/s  eta {eta / 60:.0f} min")
                    acc = {"loss": 0.0, "fm": 0.0, "ce": 0.0, "target": 0.0, "plan": 0.0, "n": 0}
                if self._val_items and (self.step % o.val_every == 0 or self.step == o.steps):
                    self._validate_and_log()
                if self.step % o.ckpt_every == 0 or self.step == o.steps:
                    ck = self.save()
                    if self.eval_hook and o.eval_every and self.step % o.eval_every == 0 and self.rank == 0:
                        self.curves["eval"].append({"step": self.step, **self.eval_hook(self.step, ck)})
                        self._write_curves()
            if stop["flag"] and self.rank == 0:
                self._say(f"\ninterrupted: stopped after step {self.step} (the last complete checkpoint is kept); "
                          "resume with --resume")
        finally:
            if self.rank == 0:
                signal.signal(signal.SIGINT, old)
        return {"step": self.step, "latest": str(self._latest()) if self._latest() else None,
                "curves": self.curves}

    def _validate_and_log(self) -> None:
        v = {"step": self.step, **self.validate()}
        self.curves["val"].append(v)
        parts = ", ".join(f"{g} {v['fm_' + g]:.4f}" for g in GROUPS if "fm_" + g in v)
        self._say(f"  validation at step {self.step}: flow {v['fm']:.4f}{f' ({parts})' if parts else ''}  "
                  f"text {v['ce']:.4f}{'  target %.4f' % v['target'] if 'target' in v else ''}"
                  f"{'  plan %.4f' % v['plan'] if 'plan' in v else ''}")

    @torch.no_grad()
    def validate(self) -> dict:
        """Flow and text losses on the fixed validation frames, plus the flow loss on its start and grasp frames
        (``fm_start`` / ``fm_grasp``, focus.py; absent when the split has none)."""
        self.model.eval()
        if self.target_head is not None:
            self.target_head.eval()
        out = self._val_losses(self._val_items)
        for name, items in self._val_group_items.items():
            if items:
                out[f"fm_{name}"] = self._val_losses(items)["fm"]
        self.model.train()
        if self.target_head is not None:
            self.target_head.train()
        return out

    @torch.no_grad()
    def _val_losses(self, val_items: list) -> dict:
        from .losses import pi05_loss, sample_time  # noqa: PLC0415

        g = torch.Generator().manual_seed(self.o.seed + 2)
        H, A = self.cfg.action_horizon, self.cfg.action_dim
        aux = self.target_head is not None
        tot = {"fm": 0.0, "ce": 0.0} | ({"target": 0.0} if aux else {}) | ({"plan": 0.0} if self.plan else {})
        n = n_target = 0
        step = self._plain_step
        for i in range(0, len(val_items), self.o.batch_size):
            items = val_items[i:i + self.o.batch_size]
            b = self.maker.make(items).to(self.device)
            noise = torch.randn(len(items), H, A, generator=g).to(self.device)
            tt = sample_time(len(items), g).to(self.device)
            _, fm, ce, tl, pl = pi05_loss(step, b, noise, tt, 1.0, target_weight=1.0 if aux else 0.0,
                                          plan=self.plan, plan_weight=1.0 if self.plan else 0.0)
            tot["fm"] += float(fm) * len(items)
            if self.plan is not None:
                tot["plan"] += float(pl) * len(items)
            tot["ce"] += float(ce) * len(items)
            if aux:                                   # over the frames whose target is valid, not over rows
                nv = int(b.target_valid.sum())
                tot["target"] += float(tl) * nv
                n_target += nv
            n += len(items)
        out = {k: v / max(1, n) for k, v in tot.items()}
        if aux:
            out["target"] = tot["target"] / max(1, n_target)
        return out

    # ------------------------------------------------------------------------------------------------ checkpoints
    def _latest(self) -> Path | None:
        link = self.out / "latest"
        if link.is_file():
            p = self.out / link.read_text().strip()
            return p if (p / "train_state.json").is_file() else None
        return None

    def save(self) -> Path | None:
        """Write checkpoints/step_NNNNNN atomically (rank 0); returns its path."""
        from oxygen_ros.model.checkpoint import save_checkpoint  # noqa: PLC0415
        from safetensors.torch import save_file  # noqa: PLC0415

        if self.rank != 0:
            return None
        name = f"step_{self.step:06d}"
        final = self.out / "checkpoints" / name
        tmp = self.out / "checkpoints" / (name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_checkpoint(self.model, tmp, layout="openpi", norm_stats=self.norm_stats, asset_id=self.o.asset_id)
        if self.tok_path is not None:
            shutil.copy2(self.tok_path, tmp / self.tok_path.name)
        opt_t, opt_meta = flatten_optimizer(self.opt)
        head = {} if self.target_head is None else {
            f"target_head.{k}": v.detach().cpu().contiguous() for k, v in self.target_head.state_dict().items()}
        save_file(opt_t | head | {"gen_state": self.gen.get_state()}, str(tmp / "train_state.safetensors"))
        state = {"step": self.step, "rng": _jsonable(self.rng.bit_generator.state), "optimizer": opt_meta,
                 "options": asdict(self.o), "bf16_autocast": self.bf16, "text_len": self.maker.text_len,
                 "val_episodes": [e.source for e in self.val_eps], "curves": self.curves,
                 "delta_action_mask": self.delta_mask.astype(int).tolist()}
        (tmp / "train_state.json").write_text(json.dumps(state, indent=1, default=str))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = self.out / "latest.tmp"
        latest_tmp.write_text(f"checkpoints/{name}\n")
        os.replace(latest_tmp, self.out / "latest")
        self._write_curves()
        return final

    def _load_state(self, d: Path) -> None:
        from safetensors.torch import load_file  # noqa: PLC0415

        st = json.loads((d / "train_state.json").read_text())
        tensors = load_file(str(d / "train_state.safetensors"))
        self.gen.set_state(tensors.pop("gen_state"))
        head = {k[len("target_head."):]: tensors.pop(k) for k in list(tensors) if k.startswith("target_head.")}
        if self.target_head is not None:
            if not head:
                raise ValueError(f"{d}: this run was not trained with --target-weight; resume it without")
            self.target_head.load_state_dict(head)
        elif head:
            raise ValueError(f"{d}: this run was trained with --target-weight; resume it with the same weight")
        restore_optimizer(self.opt, tensors, st["optimizer"])
        self.rng.bit_generator.state = st["rng"]
        self.step = int(st["step"])
        self.curves = st.get("curves", self.curves)
        self.maker.text_len = int(st["text_len"])

    def _write_curves(self) -> None:
        (self.out / "curves.json").write_text(json.dumps(self.curves, indent=1))
        try:
            plot_curves(self.curves, self.out / "curves.png")
        except Exception as exc:  # noqa: BLE001 - a plot never stops training
            self._say(f"(curves.png not written: {exc})")


def params_of(*modules) -> list:
    """The parameters of the given modules (None skipped), for gradient clipping."""
    return [p for m in modules if m is not None for p in m.parameters()]


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (np.integer,)):
        return int(x)
    return x
