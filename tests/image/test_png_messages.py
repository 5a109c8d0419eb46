"""Skip reasons for broken PNGs are readable: chunk types only when they are real ones."""

from __future__ import annotations

import struct

import pytest

from fastload.image.policy import BadImage, prepare
from helpers import photo, png_bytes


def test_a_garbled_chunk_header_is_described_by_where_it_is_not_by_its_bytes_as_text():
    good = png_bytes(photo(64, 48, seed=4))
    i = good.index(b"IDAT") - 4
    (length,) = struct.unpack(">I", good[i:i + 4])
    # the IDAT claims fewer bytes than it has: the next "chunk header" is read from compressed data
    bad = good[:i] + struct.pack(">I", length // 2) + good[i + 4:i + 8 + length]
    at = i + 12 + length // 2
    kind = bad[at + 4:at + 8]
    assert not kind.isalpha()  # the bytes standing in for a chunk type are not letters
    with pytest.raises(BadImage) as exc:
        prepare(bad)
    message = str(exc.value)
    assert message.isascii() and message.isprintable(), message
    assert f"at byte {at:,}, where the next chunk header is unreadable (type bytes {kind.hex(' ')}" in message


def test_a_real_chunk_type_is_named():
    good = png_bytes(photo(64, 48, seed=4))
    with pytest.raises(BadImage, match=r"cut short inside its IDAT chunk at byte 33 \(it claims"):
        prepare(good[:good.index(b"IDAT") + 40])
