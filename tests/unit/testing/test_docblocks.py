"""The docs test's reader of shell blocks (disco_clip_ds.testing.docblocks), on a hand-written page."""

from disco_clip_ds.testing.docblocks import Block, blocks, pages
from disco_clip_ds.testing.launch import REPO

PAGE = """# A page

```bash
disco-clip data demo --output data/demo   # a comment
disco-clip eval --model M \\
    --data data/demo/eval
```

<!-- docs-test: skip (needs a GPU) -->
```sh
nvidia-smi
```

```python
print("not a shell block")
```

```` ```bash ```` in a line of prose opens no block.

````console
$ disco-clip plan --gpus 8 \\
    --gpu_memory 40GB
fits: yes
```bash
inside a four-backtick fence: not a block of its own
```
$ echo done
done
````
"""


def test_blocks_reads_shell_blocks_their_lines_skip_marks_and_console_prompts(tmp_path):
    (tmp_path / "page.md").write_text(PAGE)
    assert blocks(tmp_path / "page.md") == [
        Block("page.md", 3, "disco-clip data demo --output data/demo   # a comment\n"
              "disco-clip eval --model M \\\n    --data data/demo/eval"),
        Block("page.md", 10, "nvidia-smi", skip="needs a GPU"),
        Block("page.md", 20, "disco-clip plan --gpus 8 \\\n    --gpu_memory 40GB\necho done"),
    ]  # fmt: skip


def test_pages_are_the_readme_and_docs_and_every_skip_mark_gives_a_reason():
    names = [p.name for p in pages(REPO)]
    assert names[0] == "README.md" and "training.md" in names
    every = [b for p in pages(REPO) for b in blocks(p)]
    assert len(every) > 20
    assert all(b.skip is None or b.skip.strip() for b in every)
