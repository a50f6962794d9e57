"""The extraction of tested blocks (tests/docs/doc_blocks.py): what counts as a tested block, and what is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from doc_blocks import marked_blocks

PAGE = """# A page

```bash
echo untested
```

```bash tested server
lucekv serve
```

````python tested
print("a fence of four holds ``` inside")
```
print("still inside")
````

  ```js tested
  console.log('indented');
  ```
"""


def test_only_blocks_marked_tested_are_taken_in_order(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    blocks = marked_blocks(page)
    assert [(b.line, b.language, b.server) for b in blocks] == [(7, "bash", True), (11, "python", False),
                                                                  (17, "js", False)]
    assert blocks[0].code == "lucekv serve\n"
    assert blocks[1].code == 'print("a fence of four holds ``` inside")\n```\nprint("still inside")\n'
    assert blocks[2].code == "console.log('indented');\n"
    assert blocks[1].name == "page.md:11"


def test_a_tested_block_in_a_language_the_runner_cannot_run_is_refused(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("```ruby tested\nputs 1\n```\n")
    with pytest.raises(ValueError, match=r"page.md:1: a tested block in 'ruby'"):
        marked_blocks(page)
