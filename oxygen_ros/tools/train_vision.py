"""``oxygen train-vision``: pretrain the model's SigLIP tower to locate the cubes in rendered simulation scenes
(``oxygen_ros/train/vision.py``), for ``oxygen train --init-vision OUT``.  Prints the validation curve (presence
accuracy, position error in cm) and writes ``OUT/vision.safetensors`` + ``OUT/vision.json``."""
from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv=None) -> int:
    from oxygen_ros.train.vision import VisionOptions, pretrain_vision  # noqa: PLC0415

    d = VisionOptions(out="")
    ap = argparse.ArgumentParser(prog="oxygen train-vision", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for vision.safetensors and vision.json")
    ap.add_argument("--preset", default=d.preset, help="model preset whose vision tower is trained")
    ap.add_argument("--scenes", type=int, default=d.scenes, help="rendered scenes (validation included)")
    ap.add_argument("--val-scenes", type=int, default=d.val_scenes)
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--arm-noise", type=float, default=d.arm_noise, help="rad per arm joint in half of the scenes")
    ap.add_argument("--first-seed", type=int, default=d.first_seed, help="scene seeds first-seed.. (keep them "
                                                                          "apart from training / evaluation seeds)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--bf16", nargs="?", const="on", default="off", choices=("on", "off", "auto"),
                    help="bf16 autocast: on needs native bf16 (avx512_bf16 / AMX), auto = where native (default: off)")
    ap.add_argument("--threads", type=int, default=d.threads)
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    a = ap.parse_args(argv)
    o = VisionOptions(**{k: v for k, v in vars(a).items()})
    try:
        s = pretrain_vision(o, log=lambda m: print(m, flush=True))
    except (ValueError, ImportError) as exc:
        print(f"oxygen train-vision: {exc}", file=sys.stderr)
        return 2
    f = s["final"]
    print(f"wrote {o.out}/vision.safetensors: presence {f['presence_accuracy']:.3f}, "
          f"error p50 {f['err_cm_p50']:.2f} cm, p90 {f['err_cm_p90']:.2f} cm")
    return 0


if __name__ == "__main__":
    sys.exit(main())
