"""refimpl's mutation fuzzer: valid files of every format refimpl reads, edited byte by byte and field by field,
each case read in a worker process under a memory and a time limit (engine.py); `python -m fuzz` from tests/
(`make fuzz`) runs 10,000 cases per format, tests/test_fuzz.py a short budget and every committed regression."""
