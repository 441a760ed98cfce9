"""Tokenizers and pre/post-processing of ``oxygen_ros/model``: the byte tokenizer round-trips any UTF-8 text and
prints placeholder words for ids past the bytes; the SentencePiece path loads a real ``.model`` file (trained here in
milliseconds, with Gemma's pad 0 / eos 1 / bos 2) from a checkpoint directory; streamed pieces concatenate to the full
decode (also across split multi-byte characters); resize-with-pad geometry and values follow openpi (keep aspect,
centre, zero pad -> -1); quantile normalisation round-trips; the pi0.5 action prompt and the language prompts have
the documented format; long prompts are truncated with a warning and a flag; bad observations raise ``ValueError``.
"""
import io
import warnings

import numpy as np
import pytest
import torch

from oxygen_ros.model import (ByteTokenizer, NormStats, Observation, Processor, SentencePieceTokenizer, build_model,
                              get_config, load_tokenizer)
from oxygen_ros.model.processing import action_prompt, discretize_state, image_to_tensor, resize_with_pad

TEXTS = ["pick up the red cup", "", "ünïcödé 日本語 🙂 tab\tnew\nline", "Task: x, State: 1 2;\nAction: "]


def spm_model(path):
    import sentencepiece as spm
    corpus = ["pick up the red cup and place it on the plate", "Task: open the drawer, State: 12 200 3;\nAction: ",
              "hello world ünïcödé 日本語"] * 20
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=buf, vocab_size=320, pad_id=0,
                                   eos_id=1, bos_id=2, unk_id=3, byte_fallback=True, model_type="bpe",
                                   character_coverage=1.0, minloglevel=2, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False)
    path.write_bytes(buf.getvalue())
    return path


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer(512)
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    for t in TEXTS:
        ids = tok.encode(t, add_bos=True)
        assert ids[0] == 2 and all(3 <= i < 259 for i in ids[1:])
        assert tok.decode(ids) == t
    assert tok.encode("A") == [ord("A") + 3]
    # ids past the bytes print as fixed placeholder words (the same for any instance), one per id
    assert tok.decode([259]) == " baba" == ByteTokenizer.placeholder(259) and tok.decode([300]) == " neba"
    assert ByteTokenizer(1024).decode([259, ord("!") + 3, 300]) == " baba! neba"
    assert len({tok.decode([i]) for i in range(259, 512)}) == 512 - 259
    assert tok.decode([ord("h") + 3, 1, 0, ord("i") + 3]) == "hi"
    with pytest.raises(ValueError):
        ByteTokenizer(100)


@pytest.mark.parametrize("kind", ["byte", "spm"])
def test_stream_decoder_concatenates_to_decode(kind, tmp_path):
    tok = ByteTokenizer(512) if kind == "byte" else SentencePieceTokenizer(spm_model(tmp_path / "t.model"))
    rng = np.random.default_rng(0)
    seqs = [tok.encode(t) for t in TEXTS] + [list(rng.integers(3, tok.vocab_size, 40))]
    for ids in seqs:
        s = tok.stream()
        pieces = [s.push(i) for i in ids]
        pieces.append(s.flush())
        assert "".join(pieces) == tok.decode(ids)
    # a 4-byte character split over tokens is held back until complete (no U+FFFD emitted mid-way)
    if kind == "byte":
        s = tok.stream()
        out = [s.push(i) for i in tok.encode("a🙂b")]
        assert out == ["a", "", "", "", "🙂", "b"]


def test_sentencepiece_from_checkpoint_dir(tmp_path):
    spm_model(tmp_path / "paligemma_tokenizer.model")
    tok = load_tokenizer(get_config("tiny"), checkpoint_dir=tmp_path)
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.vocab_size) == (0, 1, 2, 320)
    ids = tok.encode("pick up the red cup", add_bos=True)
    assert ids[0] == 2 and tok.decode(ids) == "pick up the red cup"
    assert isinstance(load_tokenizer(get_config("tiny"), checkpoint_dir=tmp_path / "none"), ByteTokenizer)
    with pytest.raises(FileNotFoundError, match="paligemma_tokenizer.model"):
        load_tokenizer(get_config("pi05"), checkpoint_dir=tmp_path / "none")


def test_resize_with_pad_geometry():
    img = np.full((100, 200, 3), 200, dtype=np.uint8)            # wide: 224 x 112, padded 56 above / below
    out = resize_with_pad(img, 224, 224)
    assert out.shape == (224, 224, 3) and out.dtype == np.uint8
    assert (out[:56] == 0).all() and (out[168:] == 0).all() and (out[56:168] == 200).all()
    tall = np.full((301, 100, 3), 50, dtype=np.uint8)            # 224 x int(100/(301/224)) = 74 wide, pad 75 / 75
    o2 = resize_with_pad(tall, 224, 224)
    cols = np.where((o2 != 0).any(axis=(0, 2)))[0]
    assert (cols.min(), cols.max()) == (75, 148)
    same = np.random.default_rng(0).integers(0, 255, (224, 224, 3), dtype=np.uint8)
    assert np.array_equal(resize_with_pad(same, 224, 224), same)
    grad = np.tile(np.linspace(0, 255, 448).astype(np.uint8)[None, :, None], (448, 1, 3))   # bilinear keeps ramps
    r = resize_with_pad(grad, 224, 224)[100, :, 0].astype(int)
    assert (np.diff(r) >= 0).all() and r[0] < 3 and r[-1] > 252


def test_processor_prepare_images_prompt_masks():
    cfg = get_config("tiny")
    tok = ByteTokenizer(cfg.vocab_size)
    stats = NormStats.from_dict({"norm_stats": {"state": {"q01": [0, -1], "q99": [2, 1]},
                                                "actions": {"q01": [-1, 0, 0], "q99": [1, 4, 2]}}})
    proc = Processor(cfg, tok, stats)
    wide = np.full((100, 200, 3), 255, dtype=np.uint8)
    obs = Observation([wide, None, np.zeros((224, 224, 3), np.uint8)], np.array([1.0, 1.0, 0.25]),
                      "  pick_up the cup\n", 1.5, 3)
    mi = proc.prepare(obs)
    assert mi.images.shape == (1, 3, 3, 224, 224) and mi.images.dtype == torch.float32
    assert mi.image_masks.tolist() == [[True, False, True]]
    assert mi.images[0, 0, :, 0].eq(-1).all() and mi.images[0, 0, :, 112].eq(1).all()     # pad -1, white +1
    assert mi.images[0, 1].eq(0).all() and mi.images[0, 2].eq(-1).all()
    # normalised state: [0.0, 1.0, 0.25] (3rd dim passes through) -> bins
    assert mi.prompt_text == "Task: pick up the cup, State: 127 255 160;\nAction: "
    n = len(mi.prompt_text.encode()) + 1
    assert mi.tokens.shape == (1, cfg.max_token_len) and int(mi.token_masks.sum()) == n and not mi.truncated
    assert tok.decode(mi.tokens[0, :n].tolist()) == mi.prompt_text and mi.tokens[0, n:].eq(0).all()
    assert mi.tokens[0, 0] == tok.bos_id
    # into a reused buffer (the engine's staging buffer) that holds an earlier frame: the same values, the masked
    # slot zeroed, no new tensor
    buf = torch.full((1, 3, 3, 224, 224), 7.0)
    again = proc.prepare(obs, images_out=buf)
    assert again.images is buf and torch.equal(buf, mi.images)
    assert torch.equal(buf[0, 0], image_to_tensor(resize_with_pad(wide, 224, 224)))     # = the allocating form


def test_prompt_formats_and_bins():
    assert action_prompt("open_the drawer ", np.array([-1.0, 0.0, 0.999])) == \
        "Task: open the drawer, State: 0 128 255;\nAction: "
    assert discretize_state(np.array([-1.0, -0.9921875, 1.0])).tolist() == [0, 1, 255]
    proc = Processor(get_config("tiny"), ByteTokenizer(512))
    for kind, text in (("subtask", "Task: wipe the table. Subtask: "),
                       ("conversation", "User: wipe the table\nAssistant: "),
                       ("memory", "Task: wipe the table. Memory: ")):
        tokens, mask, trunc = proc.encode_prompt(kind, "wipe_the table")
        assert proc.tokenizer.decode(tokens[0][mask[0]].tolist()) == text and not trunc
    with pytest.raises(ValueError, match="unknown prompt kind"):
        proc.encode_prompt("poem", "x")


def test_truncation_warns_and_flags():
    cfg = get_config("tiny")
    proc = Processor(cfg, ByteTokenizer(512))
    with pytest.warns(UserWarning, match="truncated"):
        tokens, mask, trunc = proc.encode_prompt("conversation", "x" * 500)
    assert trunc and mask.all() and tokens.shape == (1, cfg.max_token_len)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not proc.encode_prompt("conversation", "short")[2]


def test_truncation_warns_once_per_change_of_prompt():
    """An over-long instruction is truncated on every cycle (its state part changes each frame): it is flagged every
    time but warned about once, until the instruction changes."""
    cfg = get_config("tiny")
    proc = Processor(cfg, ByteTokenizer(512))
    long_task = "stack the blocks " * 20
    with pytest.warns(UserWarning, match="truncated"):
        assert proc.encode_prompt("action", long_task, state=np.zeros(14))[2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(5):
            assert proc.encode_prompt("action", long_task, state=np.full(14, 0.1 * i))[2]
    with pytest.warns(UserWarning, match="truncated"):
        assert proc.encode_prompt("action", "wipe the table " * 20, state=np.zeros(14))[2]


def test_shipped_config_action_prompt_fits_tiny():
    """The shipped config's action prompt (the synthetic bag's instruction + 14 joints) is not truncated by tiny."""
    from oxygen_ros.tools.bags.replay import DEFAULT_INSTRUCTION, JOINT_NAMES
    proc = Processor(get_config("tiny"), ByteTokenizer(512))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not proc.encode_prompt("action", DEFAULT_INSTRUCTION, state=np.ones(len(JOINT_NAMES)))[2]


def test_norm_stats_round_trip_and_unnormalize(tmp_path):
    stats = NormStats.from_dict({"norm_stats": {"state": {"q01": [0, -1], "q99": [2, 1]},
                                                "actions": {"q01": [-1, 0, 0], "q99": [1, 4, 2],
                                                            "mean": [0, 0, 0], "std": [1, 1, 1]}}})
    stats.save(tmp_path / "ns.json")
    again = NormStats.load(tmp_path / "ns.json")
    x = np.random.default_rng(0).uniform(-3, 3, (10, 5))
    assert np.allclose(again.unnormalize_actions(again.normalize_actions(x)), x, atol=1e-5)
    assert np.allclose(stats.unnormalize_actions(np.array([-1.0, 1.0, 0.0, 0.7])), [-1, 4, 1, 0.7], atol=1e-5)
    assert np.allclose(stats.normalize_state(np.array([2.0, 0.0, 9.0])), [1, 0, 9], atol=1e-5)
    proc = Processor(get_config("tiny"), ByteTokenizer(512), stats)
    acts = proc.unnormalize_actions(torch.zeros(10, 32))
    assert acts.shape == (10, 3) and np.allclose(acts[0], [0, 2, 1], atol=1e-5)
    assert Processor(get_config("tiny"), ByteTokenizer(512), stats, action_dims=5).unnormalize_actions(
        np.zeros((10, 32))).shape == (10, 5)
    ident = Processor(get_config("tiny"), ByteTokenizer(512))
    assert np.array_equal(ident.unnormalize_actions(np.ones((2, 32))), np.ones((2, 32)))


@pytest.mark.parametrize("obs, msg", [
    (Observation([None, None]), "3 camera slots"),
    (Observation([np.zeros((10, 10, 3), np.float32), None, None]), "uint8"),
    (Observation([np.zeros((10, 10), np.uint8), None, None]), r"\[H, W, 3\]"),
    (Observation([np.zeros((10, 10, 4), np.uint8), None, None]), r"\[H, W, 3\]"),
    (Observation([None, None, None], state=np.array([1.0, np.nan])), "NaN"),
    (Observation([None, None, None], state=np.array([1.0, np.inf])), "NaN or inf"),
    (Observation([None, None, None], state=np.zeros((2, 2))), "1-D"),
    (Observation([None, None, None], prompt=None), "prompt"),
])
def test_validation_errors(obs, msg):
    proc = Processor(get_config("tiny"), ByteTokenizer(512))
    with pytest.raises(ValueError, match=msg):
        proc.prepare(obs)


def test_end_to_end_observation_to_robot_actions():
    """Observation -> prepare -> prefill -> sample_actions -> robot units: the first 7 model dims, each mapped back
    with its own quantiles (x + 1) / 2 * (q99 - q01 + 1e-6) + q01; the 25 padding dims are dropped."""
    cfg = get_config("tiny")
    q01, q99 = np.arange(7) * 0.5 - 1.0, np.arange(7) * 0.5 + np.arange(1, 8)
    stats = NormStats.from_dict({"norm_stats": {"state": {"q01": [0] * 7, "q99": [1] * 7},
                                                "actions": {"q01": q01.tolist(), "q99": q99.tolist()}}})
    model, proc = build_model(cfg), Processor(cfg, ByteTokenizer(cfg.vocab_size), stats)
    obs = Observation([np.zeros((480, 640, 3), np.uint8), None, np.full((240, 320, 3), 9, np.uint8)],
                      np.linspace(0, 1, 7), "stack the blocks")
    mi = proc.prepare(obs)
    assert mi.image_masks.tolist() == [[True, False, True]]
    prefix = model.prefill(mi.images, mi.image_masks, mi.tokens, mi.token_masks, want_logits=True)
    raw = model.sample_actions(prefix, torch.randn(1, cfg.action_horizon, cfg.action_dim,
                                                   generator=torch.Generator().manual_seed(0)))[0].numpy()
    acts = proc.unnormalize_actions(torch.from_numpy(raw))
    assert acts.shape == (cfg.action_horizon, 7) and np.ptp(raw[:, :7]) > 0
    np.testing.assert_allclose(acts, (raw[:, :7] + 1) / 2 * (q99 - q01 + 1e-6) + q01, rtol=1e-6, atol=1e-6)


def test_resize_matches_pil_bilinear_within_one_level():
    """openpi resizes numpy images with PIL's bilinear filter; ours (torch, antialiased) agrees to 1/255."""
    Image = pytest.importorskip("PIL.Image")

    def pil_resize_with_pad(img, h, w):
        ch, cw = img.shape[:2]
        ratio = max(cw / w, ch / h)
        rh, rw = int(ch / ratio), int(cw / ratio)
        r = np.array(Image.fromarray(img).resize((rw, rh), resample=Image.BILINEAR))
        out = np.zeros((h, w, 3), np.uint8)
        out[(h - rh) // 2:(h - rh) // 2 + rh, (w - rw) // 2:(w - rw) // 2 + rw] = r
        return out

    rng = np.random.default_rng(0)
    for shape in [(480, 640, 3), (100, 300, 3), (256, 256, 3), (120, 160, 3)]:
        img = rng.integers(0, 256, shape, dtype=np.uint8)
        diff = np.abs(resize_with_pad(img, 224, 224).astype(int) - pil_resize_with_pad(img, 224, 224).astype(int))
        assert diff.max() <= 1 and diff.mean() < 0.05, shape


def test_action_prompt_without_discrete_state(tmp_path):
    """openpi's discrete_state_input=False (e.g. pi05_libero): BOS + cleaned prompt, then "\n" tokenised alone."""
    from oxygen_ros.model.checkpoint import config_from_json
    cfg = config_from_json({"action_dim": 32, "action_horizon": 10, "paligemma_variant": "gemma_2b",
                            "action_expert_variant": "gemma_300m", "precision": "bfloat16",
                            "discrete_state_input": False})
    assert cfg.discrete_state_input is False and get_config("pi05").discrete_state_input is True
    tok = SentencePieceTokenizer(spm_model(tmp_path / "t.model"))
    assert tok.encode("lift the bowl") + tok.encode("\n") != tok.encode("lift the bowl\n")   # why it matters
    proc = Processor(get_config("tiny", discrete_state_input=False), tok)
    mi = proc.prepare(Observation([None, None, None], np.array([0.3, 0.1]), " lift_the bowl "))
    n = int(mi.token_masks.sum())
    assert mi.prompt_text == "lift the bowl\n"
    assert mi.tokens[0, :n].tolist() == [2] + tok.encode("lift the bowl") + tok.encode("\n")


@pytest.mark.parametrize("h,w", [(1000, 2), (2, 1000), (3, 500), (4000, 30)])
def test_degenerate_frames_are_refused_clearly_never_crash_the_resize(h, w):
    """A structurally valid frame whose short side shrinks to nothing in resize-with-pad (1000x2 -> 224x0) used to
    raise inside torch's interpolate on every cycle; now the model's validation names the problem, and the resize
    itself still works (>= 1 px)."""
    from oxygen_ros.model.processing import unusable_image_reason
    cfg = get_config("tiny")
    img = np.full((h, w, 3), 200, np.uint8)
    assert resize_with_pad(img, cfg.image_size, cfg.image_size).shape == (cfg.image_size, cfg.image_size, 3)
    assert "shrinks" in unusable_image_reason(h, w, cfg.image_size)
    proc = Processor(cfg, ByteTokenizer(512))
    with pytest.raises(ValueError, match="camera slot 1: .*shrinks"):
        proc.prepare(Observation(images=[np.zeros((224, 224, 3), np.uint8), img, None], prompt="x"))


@pytest.mark.parametrize("h,w", [(480, 640), (224, 224), (720, 1280), (100, 700)])
def test_ordinary_frames_are_usable(h, w):
    from oxygen_ros.model.processing import unusable_image_reason
    assert unusable_image_reason(h, w, 224) is None
