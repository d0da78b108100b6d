"""kvflow.utils: byte sizes as users write them."""

from __future__ import annotations

import pytest

from kvflow.utils import human_bytes, parse_bytes

KiB, MiB, GiB = 1024, 1024**2, 1024**3


@pytest.mark.parametrize(
    "text, value",
    [
        ("536870912", 512 * MiB),
        ("512MiB", 512 * MiB),
        ("512mib", 512 * MiB),
        ("8GiB", 8 * GiB),
        ("8 GiB", 8 * GiB),
        ("1.5G", 3 * GiB // 2),
        ("2GB", 2 * 10**9),
        ("64KiB", 64 * KiB),
        ("100B", 100),
        (4096, 4096),
    ],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "8 GiBs", "-1", "1..5G", True, 1.5, -3, None])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_human_bytes():
    assert human_bytes(524288) == "512 KiB"
    assert human_bytes(46080) == "45 KiB"
    assert human_bytes(100) == "100 B"
    assert human_bytes(3.5 * GiB) == "3.5 GiB"




def test_parse_bytes_names_the_field():
    with pytest.raises(ValueError, match="swap_space_bytes"):
        parse_bytes("much", "swap_space_bytes")
