"""Property tests of what a card or suite.md shows (data/redact.public_text): whatever text goes in, what comes out is
one line with no raw HTML, no unescaped table pipe or link bracket, no absolute local path and no known secret."""

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from disco_clip_ds.data.redact import find_secret, public_text

PIECES = st.sampled_from(
    [
        "/home/user/data",
        "/tmp/x/y.tar",
        "~/secrets/key",
        "https://u:pw123@host/p?token=zz99",
        "hf_" + "A" * 30,
        "AKIA" + "B" * 16,
        "ghp_" + "c" * 36,
        "<b>",
        "</script>",
        "|",
        "[x](javascript:1)",
        "`code`",
        "\n",
        "\r\n",
        "\\",
        "*",
        "&amp;",
        "é",
        "\x00",
    ]
)
TEXT = st.lists(st.one_of(PIECES, st.text(max_size=12)), max_size=8).map("".join)


@settings(max_examples=100, derandomize=True, deadline=None)
@given(TEXT)
def test_public_text_is_one_safe_table_cell(text):
    shown = public_text(text)
    assert "\n" not in shown and "\r" not in shown
    assert "<" not in shown and ">" not in shown
    assert not re.search(r"(?<!\\)[|\[\]`*]", shown.replace("\\\\", ""))
    assert not re.search(r"(?<![\w:/.~<-])~?/[^\s,;<>]+/", shown)  # no absolute path of two parts or more
    assert find_secret(shown) is None
