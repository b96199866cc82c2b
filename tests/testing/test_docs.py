"""docs/testing.md runs: every ```python block, in order, as one script (its own asserts and pytest.raises check
that the worked examples pass their honest kernels and catch their seeded bugs)."""

import pathlib
import re

import numpy as np

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "testing.md"


def test_every_python_block_of_docs_testing_md_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 6
    namespace = {"__name__": "docs_testing"}
    for i, block in enumerate(blocks):
        if "pytest_plugins" in block:  # a conftest.py snippet, not a script
            continue
        exec(compile(block, f"{DOC}:block{i}", "exec"), namespace)
    assert isinstance(namespace["expected"], np.ndarray)
    printed = capsys.readouterr().out.strip()
    shown = re.search(r"```text\n(.*?)```", DOC.read_text(), flags=re.S).group(1).strip()
    assert printed == shown  # the failure message the page shows is the one the code prints
