"""Tables and words the kit writes (core/text.py)."""



from lightning_opkit.core.text import markdown_table


def test_markdown_table_escapes_pipes():
    assert markdown_table(["x"], [["a|b"]]).splitlines()[-1] == "| a\\|b |"
