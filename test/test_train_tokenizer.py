"""``train/tokenizer.py``: the domain SentencePiece vocabulary a trained checkpoint ships.  Its documented properties,
on a vocabulary trained here from the simulation's own texts and on the shipped ``checkpoints/demo`` one: Gemma's
special ids; every state bin "0".."255" of the action prompt one piece (so the 14-joint state costs 14 tokens, never
split by the corpus's statistics); the domain's words whole; byte fallback (any text encodes and round-trips up to
whitespace, no unknown id); a vocabulary too small for its fixed pieces refused; and every action prompt the
simulation's tasks produce fits the demo model's ``max_token_len`` with the state intact (truncation would cut the state)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from oxygen_ros.model.processing import NUM_STATE_BINS, action_prompt, discretize_state, language_prompt
from oxygen_ros.train.tokenizer import train_tokenizer

spm = pytest.importorskip("sentencepiece")

REPO = Path(__file__).resolve().parents[1]
DEMO_TOKENIZER = REPO / "checkpoints" / "demo" / "paligemma_tokenizer.model"


def _sim_texts():
    from oxygen_ros.sim.tasks import MEMORY_PROMPT, QUESTIONS, TASKS, draw_task
    instr = sorted({draw_task(t, s).instruction for t in TASKS for s in range(200)})
    return instr, [language_prompt("conversation", q) for q in QUESTIONS] + [language_prompt("memory", MEMORY_PROMPT)]


def _states(n, seed=0):
    return np.random.default_rng(seed).uniform(-1, 1, size=(n, 14))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    instr, lang = _sim_texts()
    lines = [action_prompt(instr[i % len(instr)], s) for i, s in enumerate(_states(400))] + instr + lang
    lines += ["a red cube and a green cube on the table; the left gripper holds the blue cube", "two", "none"]
    path = train_tokenizer(lines, tmp_path_factory.mktemp("tok") / "paligemma_tokenizer.model", vocab_size=700)
    return spm.SentencePieceProcessor(model_file=str(path))


def _processors(trained):
    out = [("trained here", trained)]
    if DEMO_TOKENIZER.is_file():
        out.append(("checkpoints/demo", spm.SentencePieceProcessor(model_file=str(DEMO_TOKENIZER))))
    return out


def test_special_ids_are_gemmas(trained):
    for name, sp in _processors(trained):
        assert (sp.pad_id(), sp.eos_id(), sp.bos_id(), sp.unk_id()) == (0, 1, 2, 3), name


def test_every_state_bin_is_one_piece_and_the_state_costs_one_token_per_joint(trained):
    for name, sp in _processors(trained):
        for i in range(NUM_STATE_BINS):
            assert sp.piece_to_id(f"\u2581{i}") != sp.unk_id(), (name, i)
        for s in _states(50, seed=1):
            pieces = sp.encode(action_prompt("pick up the red cube", s), out_type=str)
            i = pieces.index(":", pieces.index("\u2581State"))
            assert pieces[i + 1:i + 15] == [f"\u2581{b}" for b in discretize_state(s)], name
            assert pieces[i + 15].startswith(";"), name


def test_the_domains_words_are_whole_pieces(trained):
    for name, sp in _processors(trained):
        for word in ("cube", "gripper", "left", "right", "table"):
            assert sp.encode(word, out_type=str) == [f"\u2581{word}"], (name, word)


@pytest.mark.parametrize("text", ["ünïcödé 日本語 🙂", "Where is the magenta cube?", "tab\tand new\nline", "x" * 30])
def test_any_text_encodes_and_round_trips_with_no_unknown_id(trained, text):
    """Up to SentencePiece's whitespace normalisation (runs of tabs / newlines / spaces read as one space - the same
    at training and at inference, so the model never sees the difference)."""
    for name, sp in _processors(trained):
        ids = sp.encode(text)
        assert sp.unk_id() not in ids and sp.decode(ids) == " ".join(text.split()), name


def test_a_vocabulary_too_small_for_its_fixed_pieces_is_refused(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer(["pick up the red cube"], tmp_path / "t.model", vocab_size=500)
    assert not (tmp_path / "t.model").exists()


def test_every_sim_action_prompt_fits_the_demo_model_with_its_state():
    if not DEMO_TOKENIZER.is_file():
        pytest.skip("no shipped demo tokenizer")
    from oxygen_ros.model import get_config
    sp = spm.SentencePieceProcessor(model_file=str(DEMO_TOKENIZER))
    limit = get_config("demo").max_token_len
    instr, lang = _sim_texts()
    worst = max(len(sp.encode(action_prompt(i, s))) + 1 for i in instr for s in _states(3, seed=2))   # + BOS
    assert worst <= limit, (worst, limit)
    assert max(len(sp.encode(p)) + 1 for p in lang) <= limit
