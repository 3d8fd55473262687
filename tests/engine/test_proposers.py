"""Draft proposers (chunkpilot.engine.speculation.proposers): what the n-gram lookup proposes, on sequences whose
answer is known by construction."""

from __future__ import annotations

import pytest

from chunkpilot.engine.speculation.proposers import NgramProposer


def test_a_repeated_passage_is_proposed_from_where_it_occurred():
    text = [5, 6, 7, 8, 9, 10, 11, 12]
    seq = [1, 2, *text, 3, 4, 5, 6, 7]  # the output has started quoting the passage
    assert NgramProposer().propose(seq, 3) == [8, 9, 10]
    assert NgramProposer().propose(seq, 50) == [8, 9, 10, 11, 12, 3, 4, 5, 6, 7]  # up to the sequence's end


def test_the_longest_match_wins_then_the_most_recent():
    # "7" alone last occurred before 99; "6 7" occurred before 42: the longer context decides
    seq = [6, 7, 42, 1, 7, 99, 2, 6, 7]
    assert NgramProposer(max_n=2).propose(seq, 1) == [42]
    assert NgramProposer(max_n=1).propose(seq, 1) == [99]  # one token of context: the latest "7"


def test_no_match_no_guess_and_no_self_match():
    assert NgramProposer().propose([1, 2, 3, 4], 4) == []
    assert NgramProposer(min_n=2).propose([1, 2, 9, 2], 4) == []  # "9 2" never occurred before; 1-grams not asked
    assert NgramProposer().propose([7], 4) == [] and NgramProposer().propose([], 4) == []
    assert NgramProposer().propose([1, 2, 1, 2], 0) == []


def test_bad_settings_say_what_to_change():
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramProposer(min_n=3, max_n=2)
