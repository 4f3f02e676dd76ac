import pytest

from kvfence_engine.tools.units import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512Mi", 512 * 1024**2), ("1Gi", 1024**3), ("1000", 1000), ("2k", 2000), ("1.5Ki", 1536)],
)
def test_sizes_accept_bytes_and_binary_suffixes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "12Xi", "-5", "Mi"])
def test_unreadable_sizes_are_refused_with_the_text(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_sizes_format_for_humans() -> None:
    assert format_size(512 * 1024**2) == "512.0Mi"
