"""A SentencePiece vocabulary for the domain, trained on the texts the model will read and write.

This file owns the tokenizer a trained checkpoint ships: ``train_tokenizer(lines, path, vocab_size)`` trains a BPE
SentencePiece model (on a corpus this small BPE keeps whole words - "cube", "gripper" - where unigram splits them into
letters), with each state bin "0".."255" of the action prompt a single piece (user-defined symbols), on the exact
strings of training - every action prompt (instruction + discretised state bins, ``model/processing.py``
``action_prompt``), every language prompt (``language_prompt``) and every answer / memory description - with the
special ids the model's config uses (pad 0, eos 1, bos 2, unk 3) and byte fallback (any text still encodes), and
writes it as ``paligemma_tokenizer.model``, the name ``model/tokenizer.py`` looks for in a checkpoint directory, so
the node loads it with the weights. ``domain_lines`` builds that corpus from episodes.
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from oxygen_ros.model.processing import NUM_STATE_BINS

__all__ = ["train_tokenizer", "domain_lines"]


def domain_lines(episodes, norm_stats, memory_prompt: str, max_states: int = 20000, seed: int = 0) -> list[str]:
    """The training corpus: action prompts (with a sample of the real normalised states), language prompts, answers."""
    from oxygen_ros.model.processing import NormStats, action_prompt, language_prompt  # noqa: PLC0415

    ns = NormStats.from_dict(norm_stats)
    rng = np.random.default_rng(seed)
    lines = set()
    frames = [(e, f) for e in episodes for f in range(e.num_frames)]
    pick = rng.permutation(len(frames))[:max_states]
    out = []
    for i in pick:
        e, f = frames[i]
        out.append(action_prompt(e.instruction[f], ns.normalize_state(e.state[f])))
    for e in episodes:
        for f in range(e.num_frames):
            lines.add(e.instruction[f])
            for kind, prompt, text in e.texts[f]:
                lines.add(language_prompt(kind, prompt))
                lines.add(text)
    lines.add(language_prompt("memory", memory_prompt))
    return out + sorted(lines)


def train_tokenizer(lines: list[str], path, vocab_size: int = 1024) -> Path:
    """Train on ``lines`` and write the model to ``path`` (returns it).  The vocabulary may come out smaller than
    ``vocab_size`` when the corpus has fewer useful pieces (``hard_vocab_limit`` off)."""
    import sentencepiece as spm  # noqa: PLC0415

    floor = 4 + 256 + NUM_STATE_BINS + 64             # specials + byte fallback + state bins + some words
    if vocab_size < floor:
        raise ValueError(f"vocab_size {vocab_size} is too small: the special ids, 256 byte-fallback pieces and "
                         f"{NUM_STATE_BINS} state bins alone need {floor - 64}; use at least {floor}")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=int(vocab_size), model_type="bpe",
        user_defined_symbols=["\u2581" + str(i) for i in range(NUM_STATE_BINS)],          # "▁0" .. "▁255"
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, byte_fallback=True, character_coverage=1.0,
        hard_vocab_limit=False, split_digits=False, num_threads=1,
        minloglevel=2, input_sentence_size=0, shuffle_input_sentence=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return path
