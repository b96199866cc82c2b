"""The HTP runs the end-to-end tests share (tests/e2e/test_htp.py, test_fault_classes.py, htp_bits.py): one case per
architecture for the test session (tests/e2e/conftest.py, `htp_cases`), its model loaded once, its float16 exports
made once per call shape, each graph compiled for the HTP once (htp.compiled_session), its goldens and its dumps
kept by what was run (the fault, the skipped rewrites, the decode calls), so a run several tests judge is run once.
With pytest-xdist (`--dist loadgroup`) every test that uses it is in the xdist group "htp": one worker holds them."""

import dataclasses
import math

import devices as D
import htp
import pytest

from refimpl.bundle import read_bundle
from refimpl.diff.compare import compare
from refimpl.diff.divergence import localise
from refimpl.diff.dump import read_dump
from refimpl.diff.policy import make_policy
from refimpl.golden import write_golden

PROMPT = [97, 11, 1879, 13, 42, 7, 99]             # one genie chunk of AR = 8 with one pad slot
GENIE = {"ar": 8, "cl": 32, "mask_floor": -1000.0}
STEPS = 2                                         # decode calls after the prompt
ARCHITECTURES = {"dense": "tiny-qwen3", "moe": "tiny-qwen3-moe", "next": "tiny-qwen3-next", "hybrid": "tiny-qwen3.5",
                 "hybrid-moe": "tiny-qwen3.5-moe"}
HTP_POLICY = {"layouts": {".": "hf-hooks"}}
LONG_PROMPT = PROMPT + [5, 300, 1200, 64, 8, 777, 31, 1500]   # one chunk of AR = 16: q_norm is [1, 16, H, D]
LONG_GENIE = {**GENIE, "ar": 16}
# one output channel x1.02 per projection, per architecture (layers 0 and 1; the hybrids' attention is layer 3):
# tests/e2e/test_htp.py and htp_table.py
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SHARED = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")
PROJECTIONS = {
    "dense": [f"model.layers.{i}.{p}" for i in (0, 1) for p in ATTENTION + MLP],
    "moe": [f"model.layers.{i}.{p}" for i in (0, 1) for p in ATTENTION],
    "next": [f"model.layers.{i}.{p}" for i in (0, 1) for p in ("linear_attn.out_proj",) + SHARED]
    + [f"model.layers.3.{p}" for p in ATTENTION],
    "hybrid": [f"model.layers.{i}.{p}" for i in (0, 1) for p in ("linear_attn.out_proj",) + MLP]
    + [f"model.layers.3.{p}" for p in ATTENTION],
    "hybrid-moe": [f"model.layers.{i}.{p}" for i in (0, 1) for p in ("linear_attn.out_proj",) + SHARED]
    + [f"model.layers.3.{p}" for p in ATTENTION],
}
GROUP = pytest.mark.xdist_group("htp")            # every HTP test on one worker: the cases are per process


@dataclasses.dataclass
class Case:
    config: dict
    arrays: dict
    model: object
    root: object
    exports: dict = dataclasses.field(default_factory=dict)   # AR -> the raw ONNX export (faults, skips: rewrite)
    prompt: list = dataclasses.field(default_factory=lambda: PROMPT)
    genie: dict = dataclasses.field(default_factory=lambda: GENIE)
    goldens: dict = dataclasses.field(default_factory=dict)
    dumps: dict = dataclasses.field(default_factory=dict)

    def golden(self, convention: str = "genie", precision: str | None = None, steps: int = STEPS):
        """The float32 golden, or the htp-fp16 emulation following its tokens."""
        key = (convention, precision, steps)
        if key not in self.goldens:
            follow = self.golden(convention, None, steps).manifest["generated_ids"] if precision else None
            params, steps = (self.genie, steps) if convention == "genie" else ({}, 0)
            path = self.root / f"golden-{convention}-{precision}-{steps}"
            model = D.reference(self.config, self.arrays, precision)
            self.goldens[key] = read_bundle(write_golden(path, model, self.prompt, source="e2e", convention=convention,
                                                         params=params, decode_steps=steps, taps=".",
                                                         decode_ids=follow))
        return self.goldens[key]

    def dump(self, fault: D.Fault | None = None, skip=(), steps: int = STEPS):
        """The HTP's genie dump of the float32 golden's tokens (prompt call and `steps` decode calls), run once per
        (fault, skipped rewrites, steps)."""
        key = (repr(fault or D.Fault()), tuple(skip), steps)
        if key not in self.dumps:
            bundle = self.golden(steps=steps)
            m, params = bundle.manifest, bundle.manifest["convention"]["params"]
            graph = htp.htp_genie_graph(self.model, self.model.config, params, self.root, fault, skip, self.exports)
            calls = D.run_genie(graph, self.model.config, [(s["graph"], s["tokens"]) for s in m["steps"]], params,
                                fault)
            self.dumps[key] = D.write_dump(calls, self.root / f"dump-{len(self.dumps)}")
        return self.dumps[key]

    def judge(self, dump_path, steps: int = STEPS):
        """`refimpl diff` of a dump three-way: the float32 golden, the htp-fp16 emulation (hf-hooks layout)."""
        bundle = self.golden(steps=steps)
        return compare(bundle, read_dump(dump_path, bundle), make_policy(HTP_POLICY, "fp16"),
                       emulated=self.golden("genie", "htp-fp16", steps))


def case(arch: str, root) -> Case:
    """One architecture's case (ARCHITECTURES), its checkpoint written under root."""
    config, arrays = D.small_preset(ARCHITECTURES.get(arch, arch))
    model = D.load_hf(D.hf_checkpoint(config, arrays, root / "checkpoint"), "float16", "eager", "batched_mm")
    return Case(config, arrays, model, root)


def long_case(short: Case, root) -> Case:
    """The same model on the 15-token prompt (one genie chunk of AR = 16): its own export, goldens and dumps."""
    return Case(short.config, short.arrays, short.model, root, prompt=LONG_PROMPT, genie=LONG_GENIE)


def margin(report) -> tuple[float, str]:
    """How far the worst tensor's NMSE stays under its three-way bar (dB), and where; tensors after a tie or fork
    (divergence.localise: they follow another branch than the golden's, passing or not) are not counted."""
    policy = make_policy(HTP_POLICY, "fp16")
    worst, where = math.inf, None
    after = localise(report)
    for r in report.results:
        if r.metrics and not r.metrics.get("integer") and r.metrics["n"] and r.reference and r.key not in after:
            slack = 10 * math.log10(policy.criteria(r.name, False, r.reference)["max_nmse"] /
                                    max(r.metrics["nmse"], 1e-300))
            if slack < worst:
                worst, where = slack, f"step {r.step} {r.name}"
    return worst, where


def first(report):
    return next(((k, key.split("/", 2)[2]) for k, key in sorted(report.first_divergence.items()) if key), None)
