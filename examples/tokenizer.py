"""Byte-level tokenizer: ids 0..255 are the UTF-8 bytes of the text, then a few specials."""

from __future__ import annotations

from collections.abc import Iterable

NUM_BYTES = 256
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259


class ByteTokenizer:
    """Encodes text as its UTF-8 bytes (optionally after ``BOS``); decoding drops specials."""

    bos_id = BOS_ID
    eos_id = EOS_ID
    pad_id = PAD_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if add_bos else ids

    def decode(self, token_ids: Iterable[int]) -> str:
        """Text of the byte ids; specials are skipped, broken UTF-8 becomes U+FFFD."""
        data = bytes(int(t) for t in token_ids if 0 <= int(t) < NUM_BYTES)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={VOCAB_SIZE}, bos={BOS_ID}, eos={EOS_ID})"
