"""Each callback's Arguments table (arguments.py) from its signature and docstring: every constructor argument in
signature order with its default, against inspect's own reading (tests/test_docs.py checks the pages carry it)."""

import inspect

import pytest

import lightning_opkit
from lightning_opkit.arguments import BEGIN, END, PAGES, arguments_markdown, docstring_arguments, replace_section


@pytest.mark.parametrize("name", sorted(PAGES.values()))
def test_the_table_has_every_argument_in_signature_order_with_its_default_and_meaning(name):
    cls = getattr(lightning_opkit, name)
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    rows = arguments_markdown(cls).splitlines()[2:]
    assert [row.split(" | ")[0].removeprefix("| `").removesuffix("`") for row in rows] == [p.name for p in params]
    meanings = docstring_arguments(cls.__doc__)
    for row, param in zip(rows, params, strict=True):
        default = row.split(" | ")[2]
        assert default == ("-" if param.default is inspect.Parameter.empty else f"`{param.default!r}`")
        assert meanings.get(param.name), f"{name}({param.name}) has no line in its docstring's Args"
        first_word = meanings[param.name].split()[0].replace("``", "`")
        assert row.split(" | ")[3].startswith(first_word)  # the meaning column is the docstring's line


def test_replace_section_keeps_what_is_outside_the_markers():
    page = f"# Title\n\n{BEGIN}\nold table\n{END}\n\nafter\n"
    assert replace_section(page, "| new |") == f"# Title\n\n{BEGIN}\n| new |\n{END}\n\nafter\n"
