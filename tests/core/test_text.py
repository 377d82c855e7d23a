"""Words the kit writes (core/text.py): reasons listed and cut, ratios in words, exceptions on one line."""

from lightning_opkit.core.text import describe_error, named_reasons, times_phrase


def test_named_reasons_are_sorted_and_cut_with_a_count_of_the_rest():
    reasons = {f"block.{i}": "too narrow" for i in range(8)}
    text = named_reasons(reasons, most=3)
    assert text.startswith("block.0 (too narrow), block.1 (too narrow), block.2 (too narrow)")
    assert text.endswith(", and 5 more")
    assert named_reasons({"a": "x"}) == "a (x)"


def test_times_phrase_says_faster_below_one_and_slower_from_one_on():
    assert times_phrase(0.25) == "4.00x faster"
    assert times_phrase(1.0) == "1.00x slower"
    assert times_phrase(3.5) == "3.50x slower"


def test_describe_error_keeps_the_first_paragraph_on_one_line_and_cuts_it():
    err = RuntimeError("line one\nline two\n\nhints nobody reads")
    assert describe_error(err) == "RuntimeError: line one line two"
    assert describe_error(ValueError("x" * 300), limit=10) == "ValueError: xxxxxxxxxx"
    assert len(describe_error(ValueError("y" * 300), limit=None)) == len("ValueError: ") + 300
