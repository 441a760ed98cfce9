"""Tokenizers for the model: the ``Tokenizer`` protocol the processor and engine use, ``SentencePieceTokenizer`` for the
real PaliGemma vocabulary (``paligemma_tokenizer.model``, read from the checkpoint directory or a given path), the
download-free ``ByteTokenizer`` for the ``tiny`` / ``bench-cpu`` presets (pad 0, eos 1, bos 2, UTF-8 bytes at 3..258,
higher ids decode to a deterministic placeholder word so random-weight output is printable), a ``StreamDecoder`` that
turns one token at a time into text pieces whose concatenation equals ``decode(all_ids)``, and ``load_tokenizer``.
"""
from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

SPM_FILENAME = "paligemma_tokenizer.model"


@runtime_checkable
class Tokenizer(Protocol):
    bos_id: int
    eos_id: int
    pad_id: int
    vocab_size: int

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids) -> str: ...


class StreamDecoder:
    """Incremental detokenizer: ``push(id)`` returns the new text piece (possibly ""), ``flush()`` the rest.
    Text that could still change (an incomplete UTF-8 sequence, shown as U+FFFD) is held back until it settles,
    so ``"".join(pieces) + flush() == tokenizer.decode(all_ids)``."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids)
        stable = text.rstrip("\ufffd")
        if not stable.startswith(self.emitted):          # the decoder rewrote earlier text: wait for flush
            return ""
        piece = stable[len(self.emitted):]
        self.emitted = stable
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        piece = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text if text.startswith(self.emitted) else self.emitted
        return piece

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.ids)


_CONSONANTS = "bdfghklmnprstvz"
_VOWELS = "aeiou"


class ByteTokenizer:
    """Byte-level tokenizer needing no files: exact round trip for any UTF-8 text."""
    OFFSET = 3

    def __init__(self, vocab_size: int = 512, pad_id: int = 0, eos_id: int = 1, bos_id: int = 2):
        if vocab_size < 256 + self.OFFSET:
            raise ValueError(f"ByteTokenizer needs vocab_size >= {256 + self.OFFSET}, got {vocab_size}")
        self.vocab_size, self.pad_id, self.eos_id, self.bos_id = vocab_size, pad_id, eos_id, bos_id

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [b + self.OFFSET for b in text.encode("utf-8")]
        return [self.bos_id] + ids if add_bos else ids

    @staticmethod
    def placeholder(token_id: int) -> str:
        """Deterministic pronounceable word for an id without a byte, e.g. 259 -> ' baba', 300 -> ' neba'."""
        n = token_id - 256 - ByteTokenizer.OFFSET
        syl = []
        for _ in range(2):
            n, r = divmod(n, len(_CONSONANTS) * len(_VOWELS))
            syl.append(_CONSONANTS[r // len(_VOWELS)] + _VOWELS[r % len(_VOWELS)])
        while n:
            n, r = divmod(n, len(_CONSONANTS) * len(_VOWELS))
            syl.append(_CONSONANTS[r // len(_VOWELS)] + _VOWELS[r % len(_VOWELS)])
        return " " + "".join(syl)

    def decode(self, ids) -> str:
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if self.OFFSET <= i < self.OFFSET + 256:
                buf.append(i - self.OFFSET)
                continue
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
            if i >= self.OFFSET + 256:
                out.append(self.placeholder(i))
            # pad / eos / bos (and other ids below OFFSET) decode to nothing
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


class SentencePieceTokenizer:
    """PaliGemma SentencePiece model; special ids are read from the file (Gemma: pad 0, eos 1, bos 2)."""

    def __init__(self, path: str | os.PathLike):
        import sentencepiece

        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer model not found: {path}")
        self.sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self.path = path
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else 0

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self.sp.encode(text, out_type=int)
        return [self.bos_id] + ids if add_bos else ids

    def decode(self, ids) -> str:
        specials = {self.pad_id, self.eos_id, self.bos_id}
        return self.sp.decode([int(i) for i in ids if int(i) not in specials])

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


def load_tokenizer(cfg, checkpoint_dir: str | os.PathLike | None = None, path: str | os.PathLike | None = None):
    """``path`` or ``<checkpoint_dir>/paligemma_tokenizer.model`` if it exists -> SentencePieceTokenizer; otherwise a
    ByteTokenizer for the small presets.  The ``pi05`` preset without a tokenizer file is an error (its vocabulary
    is the PaliGemma one)."""
    if path is None and checkpoint_dir is not None:
        cand = os.path.join(os.fspath(checkpoint_dir), SPM_FILENAME)
        if os.path.isfile(cand):
            path = cand
    if path is not None:
        tok = SentencePieceTokenizer(path)
        if tok.vocab_size > cfg.vocab_size:
            raise ValueError(f"tokenizer vocab {tok.vocab_size} exceeds the model's {cfg.vocab_size}")
        return tok
    if cfg.vocab_size >= 100_000:
        raise FileNotFoundError(
            f"{SPM_FILENAME} not found (looked in {checkpoint_dir!r}); the {cfg.name} model needs the PaliGemma "
            "SentencePiece model: put it in the checkpoint directory or pass its path")
    return ByteTokenizer(cfg.vocab_size, pad_id=cfg.pad_id, eos_id=cfg.eos_id, bos_id=cfg.bos_id)
