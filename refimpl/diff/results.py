"""What a comparison produces: a Result per compared tensor, a Report per run.

Status of a tensor: pass | fail | layout (matches the golden only when read in another layout, e.g. an
untransposed key cache) | error (unreadable, truncated, wrong shape) | missing (a graph output not dumped) |
diverged (three-way: downstream of an exact tie the device broke the other way, or of a fork; not judged) | ignored (a
policy's ignore, on re-judging saved metrics).
"""

import dataclasses

FAILING = ("fail", "layout", "error")


@dataclasses.dataclass
class Result:
    key: str
    step: int
    role: str
    name: str
    status: str                      # pass | fail | layout | error | missing | diverged
    op: str | None = None
    layer: int | None = None
    metrics: dict | None = None
    logits: dict | None = None
    failures: list = dataclasses.field(default_factory=list)
    layout: str | None = None        # adapter the dump was read with (declared or detected)
    problem: str | None = None
    positions: dict | None = None    # absolute token position -> SQNR dB of that row
    origin: str | None = None        # for failures: "added" (all inputs pass) or "inherited"
    reference: dict | None = None    # three-way: the emulated run's metrics on this tensor
    source: str | None = None
    bar: dict | None = None          # the criteria it was judged by (policy.bar): max_nmse, channel_max_nmse, ...
    fault: dict | None = None        # a first divergence: the kind of fault it shows (classify.Fault.to_dict())


@dataclasses.dataclass
class Report:
    bundle: str
    dump: str
    policy: dict
    results: list
    first_divergence: dict           # step -> key (or None)
    unknown: list
    absent: int                      # taps / inputs the dump does not hold (not scored)
    notes: list
    config: dict | None = None       # the bundle's model config and convention: the layer DAG, for re-judging
    convention: dict | None = None

    @property
    def failed(self) -> list:
        return [r for r in self.results if r.status in FAILING]

    @property
    def missing(self) -> list:
        return [r for r in self.results if r.status == "missing"]

    @property
    def exit_code(self) -> int:
        """1 when a tensor fails, is unreadable, or a graph output is missing from the dump; else 0."""
        return 1 if self.failed or self.missing else 0
