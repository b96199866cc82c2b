"""The routed experts' checkpoint layouts: one tensor per expert (Qwen3-MoE, Qwen3-Next) or fused (Qwen3.5-MoE:
experts.gate_up_proj [E, 2Ie, H], experts.down_proj [E, H, Ie]); one splitter for every reader and writer.
"""

import re

FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(r"^(.*\.experts\.\d+)\.(gate|up|down)_proj\.weight$")


def expert_names(prefix: str, e: int) -> tuple[str, str, str]:
    """The names of routed expert e's matrices stored one tensor per expert (Qwen3-MoE, Qwen3-Next checkpoints):
    `{prefix}.{e}.gate_proj.weight`, `.up_proj.weight`, `.down_proj.weight`; prefix e.g. model.layers.0.mlp.experts."""
    return tuple(f"{prefix}.{e}.{p}_proj.weight" for p in ("gate", "up", "down"))


def split_gate_up(gate_up):
    """The fused experts' gate_up_proj (one expert's [2Ie, H], or the stack [E, 2Ie, H]) -> (gate, up), each
    [..., Ie, H], as views: the gate projection is the first half of the rows, the up projection the second."""
    half = gate_up.shape[-2] // 2
    return gate_up[..., :half, :], gate_up[..., half:, :]


def per_expert_tensors(prefix: str, gate_up_proj=None, down_proj=None) -> dict:
    """Fused experts under `prefix` (gate_up_proj [E, 2Ie, H], down_proj [E, H, Ie]: Qwen3.5-MoE's layout; either
    may be left out) as the per-expert tensors of `expert_names`: gate, up [Ie, H] and down [H, Ie] (views)."""
    out = {}
    if gate_up_proj is not None:
        for e in range(gate_up_proj.shape[0]):
            gate, up, _ = expert_names(prefix, e)
            out[gate], out[up] = split_gate_up(gate_up_proj[e])
    if down_proj is not None:
        for e in range(down_proj.shape[0]):
            out[expert_names(prefix, e)[2]] = down_proj[e]
    return out
