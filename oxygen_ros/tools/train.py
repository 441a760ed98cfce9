"""``oxygen train``: train (or fine-tune) the package's pi0.5 on rosbag2 episode bags - the bags of
``oxygen sim-record`` or a robot's own recordings - into a checkpoint the node loads.

This file owns the command line; the work is in ``oxygen_ros/train/`` (``trainer.py``).  The topic mapping: camera
topics (-> the model's slots) and joint names come from the node's parameter file (``--params``, default
config/sim_aloha.yaml: the robot's own mapping; read here with the node's ``ros/parameters.py`` into the
``RobotLayout`` the trainer takes), the other topics from ``--*-topic``.  Run it under ``torchrun
--nproc_per_node N`` for distributed data parallel training (gloo on CPU, NCCL on GPUs).  ``--eval-every N`` runs
``--eval-episodes`` closed-loop lockstep episodes per task of ``--eval-tasks`` on seeds ``--eval-seeds`` with each
checkpoint and plots their success with the losses.
"""
from __future__ import annotations

import argparse
import sys

__all__ = ["main", "robot_layout"]


def robot_layout(params: str | None):
    """The ``train.data.RobotLayout`` of a node parameter file (None: config/sim_aloha.yaml), validated as the node
    validates it (``ConfigureError`` / ``FileNotFoundError`` when it cannot be used)."""
    from oxygen_ros.ros.parameters import Settings, load_params_file, package_config  # noqa: PLC0415
    from oxygen_ros.train.data import RobotLayout  # noqa: PLC0415

    return RobotLayout.of(Settings.from_values(load_params_file(params or package_config("sim_aloha.yaml"))))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="oxygen train", description=__doc__.split("\n\n")[0])
    ap.add_argument("bags", nargs="+", help="rosbag2 bag directories (or folders holding them)")
    ap.add_argument("--out", required=True, help="run folder: checkpoints/, latest, curves.json/png, tokenizer/")
    ap.add_argument("--params", default=None, help="node parameter file with the topic mapping (default "
                                                   "config/sim_aloha.yaml)")
    ap.add_argument("--preset", default="demo", help="model size to train from scratch (tiny, demo, bench-cpu, pi05)")
    ap.add_argument("--init", default=None, help="start from this checkpoint (fine-tuning; its architecture)")
    ap.add_argument("--init-vision", default=None, help="a pretrained vision tower (oxygen train-vision's "
                                                        "vision.safetensors or its folder) for a model built from scratch")
    ap.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    ap.add_argument("--stop-after", type=int, default=None, metavar="N",
                    help="stop after step N of --steps, as Ctrl-C would; N must be a multiple of --ckpt-every, so the "
                         "run stops on a checkpoint (--resume continues on the same schedule, or with another --steps "
                         "on a new one)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=32, help="global batch (split over torchrun processes)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--text-weight", type=float, default=0.5, help="weight of the text cross-entropy (0 = off)")
    ap.add_argument("--horizon", type=int, default=None,
                    help="action chunk rows (default: the preset's, or the --init checkpoint's; another one fine-tunes "
                         "it to plan that many rows - no weight depends on it - with norm stats recomputed)")
    ap.add_argument("--vocab-size", type=int, default=1024, help="SentencePiece vocabulary (at most)")
    ap.add_argument("--bf16", nargs="?", const="on", default="off", choices=("on", "off", "auto"),
                    help="bf16 autocast: --bf16 (= on) needs native bf16 (GPUs, avx512_bf16 / AMX CPUs) and is refused "
                         "elsewhere (emulated: several times slower than fp32); auto = on where native, else fp32 (default: off)")
    ap.add_argument("--augment", action="store_true", help="shift / re-light the base camera")
    ap.add_argument("--compile", action="store_true", help="torch.compile the training step (a few minutes to "
                                                          "build; faster steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--val-fraction", type=float, default=0.05, help="episodes held out for validation")
    ap.add_argument("--val-every", type=int, default=500)
    ap.add_argument("--ckpt-every", type=int, default=1000)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--device", default="auto", help="auto (cuda when available, else cpu) | cpu | cuda | cuda:N")
    ap.add_argument("--locate-in-instruction", action="store_true",
                    help="experiment: append the named cube's cell (the frame's 'Where is the <colour> cube?' text "
                         "target) to every instruction; evaluate with oxygen sim-eval --locate-prompt")
    ap.add_argument("--state-noise", type=float, default=0.0,
                    help="experiment: Gaussian noise (rad) on the arm joints of the state in the action prompt (not in "
                         "the targets), against the copycat shortcut; 0 = off")
    ap.add_argument("--no-state-input", action="store_true",
                    help="leave the joint state out of the action prompt (openpi's discrete_state_input=False, as in "
                         "pi05_libero): the policy must plan from the images, so the arm's pose cannot carry the motion "
                         "(the copycat shortcut, oxygen sim-diagnose --copycat); saved in the checkpoint, so the node "
                         "sends the prompt without state for it")
    ap.add_argument("--focus", default="", metavar="GROUP=W[,GROUP=W]",
                    help="draw the frames vision decides more often: start (an episode's first 0.3 s) and grasp (0.3 s "
                         "before to 0.1 s after a gripper / absolute column's command changes by > 10 %% of its "
                         "range), e.g. start=4,grasp=4 "
                         "(train/focus.py); validation reports their flow loss apart either way")
    ap.add_argument("--target-weight", type=float, default=0.0,
                    help="auxiliary target: a linear head on the action expert's hidden state regresses the named "
                         "cube's table place (train/target_aux.py; training only, not in the checkpoint), weighted "
                         "by this against the flow loss; 0 = off")
    ap.add_argument("--target-within", type=float, default=None, metavar="S",
                    help="the auxiliary target only on each episode's first S seconds (where the pose cannot tell "
                         "where the arm is going: the head must read the images); default: every frame")
    ap.add_argument("--plan-weight", type=float, default=0.0,
                    help="a target on the plan itself: the squared distance (in 5 cm units) between the grip sites "
                         "of the denoiser's estimate of the clean chunk and of the label, through both arms' forward "
                         "kinematics (train/plan_target.py; needs the simulation's MuJoCo model), weighted by this "
                         "against the flow loss; 0 = off")
    ap.add_argument("--asset-id", default="sim_aloha", help="norm stats folder name under assets/")
    for name, default in (("actions", "/executed_action"), ("joint-states", "/joint_states"),
                          ("instruction", "/instruction"), ("episode", "/episode"), ("text-targets", "/text_targets")):
        ap.add_argument(f"--{name}-topic", default=None, help=f"default {default}")
    ap.add_argument("--eval-every", type=int, default=0, help="closed-loop evaluation every N steps (0 = off)")
    ap.add_argument("--eval-tasks", default="reach")
    ap.add_argument("--eval-seeds", default="900000:900003", help="evaluation seeds (never recorded for training)")
    ap.add_argument("--quiet", action="store_true")
    return ap


def _eval_hook(tasks: str, seeds: str):
    def hook(step: int, ckpt) -> dict:
        from oxygen_ros.tools.sim.eval import run_grid, _cells  # noqa: PLC0415
        from oxygen_ros.tools.sim.record import parse_seeds  # noqa: PLC0415

        common = {"policy": str(ckpt), "params": None, "overrides": {}, "camera_size": 96, "camera_every": 5,
                  "horizon": 20, "out": str(ckpt)}
        eps = run_grid(common, _cells(["oxygen"], ["blend"], [0.0], ["none"]), tasks.split(","),
                       parse_seeds(seeds), 1, False, quiet=True)
        ok = [e for e in eps if not e.get("error")]
        return {"success": sum(e["success"] for e in ok) / max(1, len(ok)), "episodes": len(ok)}
    return hook


def main(argv=None) -> int:
    from oxygen_ros.ros.parameters import ConfigureError  # noqa: PLC0415
    from oxygen_ros.train.data import DataError  # noqa: PLC0415
    from oxygen_ros.train.focus import parse_focus  # noqa: PLC0415
    from oxygen_ros.train.trainer import Trainer, TrainOptions  # noqa: PLC0415

    ap = _parser()
    a = ap.parse_args(argv)
    for flag in ("steps", "batch_size", "ckpt_every", "val_every", "log_every"):      # counts and periods
        if getattr(a, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if a.stop_after is not None and not 1 <= a.stop_after <= a.steps:
        ap.error(f"--stop-after must be 1..--steps ({a.steps}), got {a.stop_after}")
    if a.stop_after is not None and a.stop_after % a.ckpt_every and a.stop_after != a.steps:
        ap.error(f"--stop-after must be a multiple of --ckpt-every ({a.ckpt_every}): a run resumes from its last "
                 f"checkpoint, got {a.stop_after}")
    if a.horizon is not None and not 1 <= a.horizon <= 1000:
        ap.error(f"--horizon must be 1..1000 rows, got {a.horizon}")
    if not 0 <= a.state_noise < float("inf"):                      # NaN fails too
        ap.error(f"--state-noise must be a finite number >= 0, got {a.state_noise}")
    if not 0 <= a.target_weight < float("inf"):
        ap.error(f"--target-weight must be a finite number >= 0, got {a.target_weight}")
    if not 0 <= a.plan_weight < float("inf"):
        ap.error(f"--plan-weight must be a finite number >= 0, got {a.plan_weight}")
    if a.target_within is not None and not (0 < a.target_within < float("inf") and a.target_weight > 0):
        ap.error(f"--target-within needs --target-weight > 0 and a finite number of seconds > 0, got "
                 f"{a.target_within}")
    if a.no_state_input and a.state_noise:
        ap.error("--state-noise perturbs the state in the prompt; with --no-state-input there is none")
    try:
        focus = parse_focus(a.focus)
    except ValueError as exc:
        ap.error(str(exc))
    topics = {"actions": a.actions_topic, "joint_states": a.joint_states_topic, "instruction": a.instruction_topic,
              "episode": a.episode_topic, "text_targets": a.text_targets_topic}
    o = TrainOptions(bags=a.bags, out=a.out, params=a.params, preset=a.preset, steps=a.steps,
                     batch_size=a.batch_size, lr=a.lr, min_lr_ratio=a.min_lr_ratio, warmup=a.warmup,
                     weight_decay=a.weight_decay, grad_clip=a.grad_clip, text_weight=a.text_weight, bf16=a.bf16,
                     compile=a.compile,
                     augment=a.augment, seed=a.seed, val_fraction=a.val_fraction, val_every=a.val_every,
                     ckpt_every=a.ckpt_every, log_every=a.log_every, vocab_size=a.vocab_size, horizon=a.horizon,
                     asset_id=a.asset_id, threads=a.threads, device=a.device, init=a.init, init_vision=a.init_vision,
                     resume=a.resume,
                     eval_every=a.eval_every, locate_in_instruction=a.locate_in_instruction,
                     state_noise=a.state_noise, state_input=not a.no_state_input, focus=focus,
                     target_weight=a.target_weight, target_within=a.target_within, plan_weight=a.plan_weight,
                     topics={k: v for k, v in topics.items() if v}, quiet=a.quiet)
    try:
        trainer = Trainer(o, robot_layout(a.params),
                          eval_hook=_eval_hook(a.eval_tasks, a.eval_seeds) if a.eval_every else None)
        trainer.setup()
    except (DataError, ValueError, FileNotFoundError, ConfigureError) as exc:
        print(f"oxygen train: error: {exc}", file=sys.stderr)
        return 2
    res = trainer.train(until=a.stop_after)
    if trainer.rank == 0:
        print(f"trained to step {res['step']}; latest checkpoint: {res['latest']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
