"""Where is the named cube's place lost between the camera and the action expert?  Three read-out probes.

* ``values CKPT``: is the place in what attention can read from the image tokens?  Attention-pooling probes with one
  learned query per colour (``train/vision.py``'s ``LocateHead``) on the top camera's tokens of 3,000 start-pose scenes
  (seeds 700000-), tested on 600 others: the tower's projected tokens [36, 128], each layer's values V [36, 32] (1 KV
  head x 32 dims), all layers' V and K.
* ``binding CKPT``: has the VLM bound the instruction's colour to that cube's place inside the action prompt's tokens
  (one hop for the action expert), or is it only in the image tokens (two hops: read the colour, then find it)?
  1,500 + 300 start-pose reach / pick scenes (seeds 800000-), the node's own prompt (instruction + state), probes with
  a single learned query (the colour must come from the tokens) on the prompt tokens' V and on the image tokens' V.
* ``head RUN_CKPT BAG``: does the action expert's own hidden state know the place at an episode's first frame?  The
  auxiliary target head of an ``oxygen train --target-weight`` checkpoint (``train/target_aux.py``, saved in its
  ``train_state.safetensors``) on frame 0 (``--frames``) of the bag's reach / pick episodes (pure noise, t = 1).

Errors are per axis, cm on the table, medians; "x sign" = the cube's side (pick's arm).  Measured 2026-12-07 (the card,
*Stage 7*): values (r0A) - tower 1.1 / 0.9 cm, one layer's V 1.5 / 1.2-1.5 cm, all K 0.5 / 0.4 cm; binding (the
shipped checkpoint) - one layer's prompt V from layer 1 on 1.8-2.1 / 2.2-2.5 cm, x sign 92-93 % (all layers 96 %), image
V with one query 3.8 / 3.3 cm, x sign 70 %; head at frame 0 (r0A / r0B) r x +0.62 / +0.83 (reach), x sign 74 / 76 %
(pick) against 100 % at frame 5, where the arm's pose shows the side.

    AMENT_PREFIX_PATH=$PWD/.venv .venv/bin/python dev/readout_probes.py binding checkpoints/demo
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn


def _fit(name, X, mask, Y, n_tr, steps=2000, queries=1, colours=False):
    """Attention-pooling probe: ``queries`` learned queries -> attention over the tokens -> MLP -> (x, y) (+ presence
    per colour when ``colours``).  Prints the held-out error; returns it."""
    from oxygen_ros.train.vision import LocateHead, locate_loss  # noqa: PLC0415

    keep = mask[:n_tr]
    X = (X - X[:n_tr][keep].mean(0)) / (X[:n_tr][keep].std(0) + 1e-6)
    W = X.shape[-1]
    torch.manual_seed(0)
    head = LocateHead(W, colours=queries, heads=4 if W % 4 == 0 else 1)
    opt = torch.optim.AdamW(head.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(0)

    def pred(idx):
        q = head.queries.expand(len(idx), -1, -1)
        o, _ = head.attn(q, X[idx], X[idx], key_padding_mask=~mask[idx], need_weights=False)
        return head.out(o)                                                        # [b, queries, 3]

    for _ in range(steps):
        idx = torch.randint(0, n_tr, (64,), generator=g)
        p = pred(idx)
        loss = locate_loss(p, Y[idx]) if colours else ((p[:, 0, 1:] - Y[idx]) ** 2).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    te = torch.arange(n_tr, len(X))
    with torch.no_grad():
        p = pred(te)
    if colours:
        pres = Y[te][..., 0] > 0.5
        d, truth = (p[..., 1:] - Y[te][..., 1:])[pres], Y[te][..., 1:][pres]
        sign_p, sign_t = p[..., 1][pres], truth[:, 0]
    else:
        d, truth = p[:, 0, 1:] - Y[te], Y[te]
        sign_p, sign_t = p[:, 0, 1], truth[:, 0]
    return d, (torch.sign(sign_p) == torch.sign(sign_t)).float().mean().item()


def values(a) -> dict:
    from oxygen_ros.model import load_checkpoint  # noqa: PLC0415
    from oxygen_ros.model.processing import image_to_tensor  # noqa: PLC0415
    from oxygen_ros.train.vision import X_SCALE, Y_SCALE, render_scenes  # noqa: PLC0415

    m = load_checkpoint(a.checkpoint).model.eval()
    n_tr, n_te = 3000, 600
    imgs, labels = render_scenes(n_tr + n_te, m.cfg.image_size, first_seed=700000, arm_noise=0.0)
    feats: dict = {}
    with torch.no_grad():
        for i in range(0, len(imgs), 100):
            x = torch.stack([image_to_tensor(im) for im in imgs[i:i + 100]])
            ims = torch.zeros(len(x), m.cfg.num_cameras, *x.shape[1:])
            ims[:, 0] = x
            msk = torch.zeros(len(x), m.cfg.num_cameras, dtype=torch.bool)
            msk[:, 0] = True
            N = m.cfg.image_tokens_per_camera
            pre = m.prefill_images(ims, msk)
            vs = [pre.v[l][:, :N, 0].float() for l in range(len(pre.v))]
            parts = {"tower": m.embed_images(ims, msk)[:, :N].float(), "V all layers": torch.cat(vs, -1),
                     "K all layers": torch.cat([pre.k[l][:, :N, 0].float() for l in range(len(pre.k))], -1)}
            parts |= {f"V layer {l}": v for l, v in enumerate(vs)}
            for k, v in parts.items():
                feats.setdefault(k, []).append(v)
    Y = torch.from_numpy(labels)
    out = {}
    for name, chunks in feats.items():
        X = torch.cat(chunks)
        d, sign = _fit(name, X, torch.ones(X.shape[:2], dtype=torch.bool), Y, n_tr, steps=1500,
                       queries=Y.shape[1], colours=True)
        ex, ey = (d[:, 0].abs() * X_SCALE * 100).median().item(), (d[:, 1].abs() * Y_SCALE * 100).median().item()
        out[name] = {"x_cm": ex, "y_cm": ey, "x_sign": sign, "tokens": list(X.shape[1:])}
        print(f"{name:>14} {list(X.shape[1:])}: |x err| {ex:.2f} cm  |y err| {ey:.2f} cm  x sign {sign:.0%}",
              flush=True)
    return out


def binding(a) -> dict:
    from oxygen_ros.model import Processor, load_checkpoint  # noqa: PLC0415
    from oxygen_ros.model.processing import Observation  # noqa: PLC0415
    from oxygen_ros.sim.scene import START_POSE, AlohaScene  # noqa: PLC0415
    from oxygen_ros.sim.tasks import draw_task  # noqa: PLC0415
    from oxygen_ros.train.target_aux import SCALE, normalise  # noqa: PLC0415

    pol = load_checkpoint(a.checkpoint)
    m = pol.model.eval()
    proc = Processor(pol.cfg, pol.tokenizer, pol.norm_stats, action_dims=14)
    n_tr, n_te = 1500, 300
    sim = AlohaScene(camera_size=(m.cfg.image_size,) * 2)
    P = m.cfg.num_cameras * m.cfg.image_tokens_per_camera
    N = m.cfg.image_tokens_per_camera
    vp, mp, vi, Y = [], [], [], []
    try:
        for i in range(n_tr + n_te):
            spec = draw_task(("reach", "pick")[i % 2], 800000 + i)
            sim.reset(spec.scene)
            c = spec.scene.cubes[spec.target_index]
            mi = proc.prepare(Observation(images=sim.render(), state=START_POSE.copy(), prompt=spec.instruction))
            with torch.no_grad():
                pre = m.prefill(mi.images, mi.image_masks, mi.tokens, mi.token_masks)
            L = mi.tokens.shape[1]
            vp.append(torch.stack([pre.v[l][0, P:P + L, 0] for l in range(len(pre.v))]).float())   # [NL, L, D]
            mp.append(mi.token_masks[0].bool())
            vi.append(torch.stack([pre.v[l][0, :N, 0] for l in range(len(pre.v))]).float())        # top camera
            Y.append(normalise((c.x, c.y)))
    finally:
        sim.close()
    vp, mp, vi = torch.stack(vp), torch.stack(mp), torch.stack(vi)
    Y = torch.tensor(np.array(Y), dtype=torch.float32)
    runs = {"prompt V, all layers": (vp.permute(0, 2, 1, 3).flatten(2), mp),
            "image V, all layers": (vi.permute(0, 2, 1, 3).flatten(2), torch.ones(vi.shape[0], N, dtype=torch.bool))}
    runs |= {f"prompt V, layer {l}": (vp[:, l], mp) for l in range(vp.shape[1])}
    out = {}
    for name, (X, msk) in runs.items():
        d, sign = _fit(name, X, msk, Y, n_tr)
        ex, ey = (d[:, 0].abs() * SCALE[0] * 100).median().item(), (d[:, 1].abs() * SCALE[1] * 100).median().item()
        out[name] = {"x_cm": ex, "y_cm": ey, "x_sign": sign}
        print(f"{name:>22}: |x err| {ex:.2f} cm  |y err| {ey:.2f} cm  x sign {sign:.0%}", flush=True)
    return out


def head(a) -> dict:
    from safetensors.torch import load_file  # noqa: PLC0415

    from oxygen_ros.model import Processor, load_checkpoint  # noqa: PLC0415
    from oxygen_ros.model.processing import Observation  # noqa: PLC0415
    from oxygen_ros.sim.tasks import draw_task  # noqa: PLC0415
    from oxygen_ros.tools.train import robot_layout  # noqa: PLC0415
    from oxygen_ros.train.data import TopicMap, load_episodes  # noqa: PLC0415
    from oxygen_ros.train.target_aux import SCALE, TargetHead, normalise  # noqa: PLC0415

    pol = load_checkpoint(a.checkpoint)
    m = pol.model.eval()
    st = load_file(f"{a.checkpoint}/train_state.safetensors")
    hd = TargetHead(pol.cfg.expert.width)
    hd.load_state_dict({k[len("target_head."):]: v for k, v in st.items() if k.startswith("target_head.")})
    proc = Processor(pol.cfg, pol.tokenizer, pol.norm_stats, action_dims=14)
    eps = load_episodes([a.bag], TopicMap.from_layout(robot_layout(None)), image_size=pol.cfg.image_size)
    out = {}
    for task in ("reach", "pick"):
        for fr in (int(f) for f in a.frames.split(",")):
            T, Pr = [], []
            for e in eps:
                if e.meta.get("task") != task or e.num_frames <= fr:
                    continue
                spec = draw_task(task, int(e.meta["seed"]))
                c = spec.scene.cubes[spec.target_index]
                mi = proc.prepare(Observation(images=list(e.images[fr]), state=e.state[fr], prompt=e.instruction[fr]))
                g = torch.Generator().manual_seed(0)
                x = torch.randn(1, pol.cfg.action_horizon, pol.cfg.action_dim, generator=g)
                with torch.no_grad():
                    h = m.forward_train(mi.images, mi.image_masks, mi.tokens, mi.token_masks, x, torch.tensor([1.0]),
                                        return_hidden=True)[2]
                    Pr.append(hd(h)[0].numpy())
                T.append(normalise((c.x, c.y)))
            T, Pr = np.array(T), np.array(Pr)
            r = [float(np.corrcoef(T[:, k], Pr[:, k])[0, 1]) for k in (0, 1)]
            sign = float(np.mean(np.sign(T[:, 0]) == np.sign(Pr[:, 0])))
            rmse = np.sqrt(((T - Pr) ** 2).mean(0)) * SCALE * 100
            out[f"{task} frame {fr}"] = {"r_x": r[0], "r_y": r[1], "x_sign": sign, "rmse_cm": rmse.tolist(),
                                         "n": len(T)}
            print(f"{task} frame {fr}: n {len(T)}  r x {r[0]:+.2f}  r y {r[1]:+.2f}  x sign {sign:.0%}  "
                  f"rmse x {rmse[0]:.1f} cm  y {rmse[1]:.1f} cm", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="probe", required=True)
    for name in ("values", "binding", "head"):
        p = sub.add_parser(name)
        p.add_argument("checkpoint")
        if name == "head":
            p.add_argument("bag")
            p.add_argument("--frames", default="0,5")
        p.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.time()
    res = {"values": values, "binding": binding, "head": head}[a.probe](a)
    print(f"({time.time() - t0:.0f} s)")
    if a.json:
        import json  # noqa: PLC0415
        with open(a.json, "w") as f:
            json.dump({"probe": a.probe, "checkpoint": a.checkpoint, "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
