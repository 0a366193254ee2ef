"""A byte-level tokenizer: every UTF-8 byte is a token, plus three special tokens.

Ids: ``PAD = 0``, ``BOS = 1``, ``EOS = 2``; byte ``b`` is id ``b + 3``
(:data:`BYTE_OFFSET`), so the vocabulary has 259 ids. Any text encodes, nothing
is unknown, and nothing needs downloading.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["BOS", "BYTE_OFFSET", "EOS", "PAD", "VOCAB_SIZE", "ByteTokenizer"]

PAD, BOS, EOS = 0, 1, 2
BYTE_OFFSET = 3
VOCAB_SIZE = 256 + BYTE_OFFSET
_SPECIAL_NAMES = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>"}


class ByteTokenizer:
    """UTF-8 bytes shifted by 3 above the special ids ``PAD=0``, ``BOS=1``, ``EOS=2``.

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.encode("hi", bos=True, eos=True).tolist()
        [1, 107, 108, 2]
        >>> tok.decode([1, 107, 108, 2, 0])
        '<bos>hi<eos><pad>'
        >>> tok.decode([229]), tok.decode([229, 133, 175])
        ('\\\\xe2', '€')
    """

    pad_token_id = PAD
    bos_token_id = BOS
    eos_token_id = EOS
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> np.ndarray:
        """The int64 ids of ``text``'s UTF-8 bytes, optionally bracketed by BOS and EOS."""
        body = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + BYTE_OFFSET
        parts = [np.array([BOS])] if bos else []
        parts.append(body)
        if eos:
            parts.append(np.array([EOS]))
        return np.concatenate(parts).astype(np.int64, copy=False)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``: ``<pad>``, ``<bos>``, ``<eos>`` (others ``<id>``); invalid UTF-8 as ``\\xNN``."""
        out: list[str] = []
        run = bytearray()
        for token in ids:
            token = int(token)
            if BYTE_OFFSET <= token < VOCAB_SIZE:
                run.append(token - BYTE_OFFSET)
                continue
            out.append(run.decode("utf-8", errors="backslashreplace"))
            run.clear()
            out.append(_SPECIAL_NAMES.get(token, f"<{token}>"))
        out.append(run.decode("utf-8", errors="backslashreplace"))
        return "".join(out)
