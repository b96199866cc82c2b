"""The fuzzer inside the suite: every committed regression case (a crash, hang or memory blow-up found once) and a
short seeded budget of every format end ok or as a clean one-line refimpl error. `make fuzz` runs the long budget."""

import json
from pathlib import Path

import pytest

from .engine import Pool, table
from .formats import FORMATS

REGRESSIONS = Path(__file__).with_name("regressions.json")
SHORT_BUDGET = 60   # seeded cases per format in `make test` (the twelve formats of tests/fuzz/formats.py)


def _run(jobs, formats):
    with Pool(formats, workers=1, memory_mib=1536) as pool:   # engine.TIME_LIMIT: 5 s of CPU per case
        results = list(pool.run(jobs))
    bad = [r for r in results if r.outcome not in ("ok", "clean")]
    assert not bad, table(results, formats) + "\n" + "\n".join(json.dumps(r.ops) for r in bad)
    return results


def test_regression_cases_are_clean():
    cases = json.loads(REGRESSIONS.read_text())
    assert cases and all(c["format"] in FORMATS for c in cases)
    formats = {c["format"]: FORMATS[c["format"]] for c in cases}
    results = _run([(c["format"], None, c["ops"]) for c in cases], formats)
    assert len(results) == len(cases)


@pytest.mark.parametrize("name", list(FORMATS))
def test_short_budget(name):
    results = _run([(name, seed, None) for seed in range(SHORT_BUDGET)], {name: FORMATS[name]})
    assert len(results) == SHORT_BUDGET
