"""Dataset-scale references (docs/dataset.md): the reference's next-token distributions over thousands of windows
of text, stored compactly and resumably, and the device's logits judged against them as llama.cpp's
`llama-perplexity --kl-divergence` judges a quantised model.

    windows = cut(read_documents(text="wiki.test.raw", tokenizer=tok), ctx=512)
    write_reference("REF/", Job("Qwen3-0.6B/", Policy()), windows, data, workers=2)      # or ray=True
    report = compare_logits(open_reference("REF/"), "output/")                           # qnn-net-run outputs
    report["kld"]["mean"], report["same_top"]["value"], report["ppl_difference"]

windows.py (cutting as llama-perplexity), compact.py (the 16-bit form and its KLD error bound), reference.py (the
directory, resumable runs, local / Ray workers), stats.py (llama-perplexity's statistics), compare.py (device
logits), report.py (table, HTML), llama.py (llama.cpp's base file), commands.py (the CLI).
"""

from .compare import compare_logits, judge, parse_policy
from .llama import read_kld_base, write_kld_base
from .reference import Job, compute_window, open_reference, write_reference
from .windows import Windows, cut, read_documents

__all__ = ["Job", "Windows", "compare_logits", "compute_window", "cut", "judge", "open_reference", "parse_policy",
           "read_documents", "read_kld_base", "write_kld_base", "write_reference"]
