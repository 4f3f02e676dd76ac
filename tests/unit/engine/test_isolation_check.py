"""The read check, alone: one vectorised function decides who may attend."""

import torch

from kvfence_engine.core.isolation import check_reads

PAGE = 4


def run(tags, fill, table, held, num_held, read_len, written_tag=None):
    t = torch.tensor
    written = t(tags if written_tag is None else written_tag)
    return check_reads(t(tags), t(fill), written, t(table), t(held), t(num_held), t(read_len), PAGE)


def test_a_sequence_reading_only_what_it_wrote_passes() -> None:
    check = run([1, 1, 1], [4, 2, 0], [[0, 1]], [[1, 1]], [2], [6])
    assert not check.failed.any()


def test_a_page_reallocated_under_a_reader_is_a_tag_mismatch() -> None:
    check = run([2, 1], [4, 4], [[0, 1]], [[1, 1]], [2], [8])
    assert check.tag_mismatch.tolist() == [True]
    assert check.unwritten.tolist() == [False]


def test_reading_a_reserved_but_unwritten_slot_is_refused() -> None:
    # 8 slots reserved over two pages, only one token written: the incident's shape.
    check = run([1, 1], [1, 0], [[0, 1]], [[1, 1]], [2], [8])
    assert check.unwritten.tolist() == [True]


def test_reading_beyond_the_reserved_pages_is_refused() -> None:
    check = run([1], [4], [[0]], [[1]], [1], [5])
    assert check.unwritten.tolist() == [True]


def test_padding_columns_are_ignored_and_rows_are_judged_independently() -> None:
    # row 0 holds one page (column 1 is padding pointing at a page with another tag)
    check = run([1, 9, 1], [3, 0, 4], [[0, 1], [2, 1]], [[1, 0], [1, 1]], [1, 2], [3, 4])
    assert check.tag_mismatch.tolist() == [False, True]
    assert check.failed.tolist() == [False, True]


def test_pages_that_will_only_be_written_are_still_tag_checked() -> None:
    check = run([1, 5], [4, 0], [[0, 1]], [[1, 4]], [2], [4])
    assert check.tag_mismatch.tolist() == [True]


def test_slots_written_under_an_older_tag_do_not_count_as_written() -> None:
    # a late transfer write from the page's previous owner filled it: not this reader's data
    check = run([3, 3], [4, 4], [[0, 1]], [[3, 3]], [2], [8], written_tag=[3, 2])
    assert check.unwritten.tolist() == [True]
