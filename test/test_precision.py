"""``--bf16`` follows the hardware (``train/precision.py``): on where bf16 is native, refused where autocast would
emulate it (an AVX2-only CPU: a training step over 3x slower than fp32, found when ``make train-demo`` crawled on such a
VM), and ``auto`` picks fp32 there.  The CPU's capability is faked both ways, so the test runs the same on any host."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oxygen_ros.train.precision import bf16_native, resolve_bf16

EPISODES_OLD = Path(__file__).resolve().parent / "data" / "episode_bag"


def fake_cpu(monkeypatch, avx512_bf16: bool, amx: bool = False) -> None:
    """The CPU's bf16 capability, as torch's probes report it."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)


@pytest.fixture(params=[False, True], ids=["avx2-only", "avx512_bf16"])
def cpu_bf16(request, monkeypatch):
    fake_cpu(monkeypatch, request.param)
    return request.param


def test_resolve_bf16_follows_the_cpu(cpu_bf16):
    cpu = torch.device("cpu")
    assert bf16_native(cpu) is cpu_bf16
    for off in (False, None, "off", "OFF"):
        assert resolve_bf16(off, cpu) is False
    assert resolve_bf16("auto", cpu) is cpu_bf16
    if cpu_bf16:
        assert resolve_bf16(True, cpu) is True and resolve_bf16("on", cpu) is True
    else:
        for on in (True, "on"):
            with pytest.raises(ValueError, match="no native bf16.*--bf16 auto"):
                resolve_bf16(on, cpu)
    with pytest.raises(ValueError, match="expected on, off or auto"):
        resolve_bf16("fast", cpu)


def test_amx_counts_as_native(monkeypatch):
    fake_cpu(monkeypatch, avx512_bf16=False, amx=True)
    assert resolve_bf16("on", torch.device("cpu")) is True


def test_oxygen_train_refuses_emulated_bf16_before_reading_any_data(monkeypatch, tmp_path, capsys):
    from oxygen_ros.tools.train import main
    fake_cpu(monkeypatch, avx512_bf16=False)
    assert main([str(EPISODES_OLD), "--out", str(tmp_path / "run"), "--device", "cpu", "--bf16"]) == 2
    err = capsys.readouterr().err
    assert "oxygen train: error: --bf16: this cpu has no native bf16" in err and "data:" not in err
    with pytest.raises(SystemExit) as e:                   # a value it does not know: argparse's usage error
        main([str(EPISODES_OLD), "--out", str(tmp_path / "run"), "--bf16", "fast"])
    assert e.value.code == 2 and "invalid choice: 'fast'" in capsys.readouterr().err


def test_oxygen_train_bf16_auto_trains_in_fp32_without_native_bf16(monkeypatch, tmp_path, capsys):
    pytest.importorskip("mujoco")
    import json

    from oxygen_ros.tools.train import main
    fake_cpu(monkeypatch, avx512_bf16=False)
    out = tmp_path / "run"
    assert main([str(EPISODES_OLD), "--out", str(out), "--device", "cpu", "--bf16", "auto", "--preset", "tiny",
                 "--steps", "2", "--batch-size", "4", "--warmup", "1", "--val-fraction", "0", "--ckpt-every", "2",
                 "--vocab-size", "640", "--threads", "1"]) == 0
    cap = capsys.readouterr()
    assert "device cpu, fp32" in cap.out + cap.err
    state = json.loads((out / "checkpoints" / "step_000002" / "train_state.json").read_text())
    assert state["options"]["bf16"] == "auto" and state["bf16_autocast"] is False
    from oxygen_ros.train.export import export_checkpoint              # and the card's training.json keeps it
    export_checkpoint(out, tmp_path / "policy")
    assert json.loads((tmp_path / "policy" / "training.json").read_text())["bf16_autocast"] is False


def test_train_vision_refuses_emulated_bf16_before_rendering(monkeypatch, tmp_path, capsys):
    from oxygen_ros.tools.train_vision import main
    fake_cpu(monkeypatch, avx512_bf16=False)
    assert main(["--out", str(tmp_path / "v"), "--scenes", "600", "--steps", "1", "--bf16"]) == 2
    err = capsys.readouterr()
    assert "no native bf16" in err.err and "rendered" not in err.out
