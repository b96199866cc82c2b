"""The MoE router's logits were tapped as `mlp.gate` (the word attention's output gate uses) and are now
`mlp.router_logits`, within bundle schema 1: diff refuses a bundle with the old name, naming the new one, instead
of letting its router tap match nothing."""

import json
import shutil
from pathlib import Path

import pytest

from refimpl.bundle import read_bundle
from refimpl.cli import main
from refimpl.diff.dump import read_dump
from refimpl.errors import FormatError

ANCHOR = Path(__file__).parent.parent.parent / "golden" / "tiny-qwen3-moe"


def old_bundle(tmp_path) -> Path:
    """The MoE anchor as the previous refimpl wrote it: the router tap named model.layers.0.mlp.gate."""
    out = tmp_path / "old"
    shutil.copytree(ANCHOR, out)
    text = (out / "manifest.json").read_text().replace("model.layers.0.mlp.router_logits", "model.layers.0.mlp.gate")
    (out / "manifest.json").write_text(text)
    for f in out.glob("steps/*/taps/model.layers.0.mlp.router_logits.raw"):
        f.rename(f.with_name("model.layers.0.mlp.gate.raw"))
    assert json.loads(text)["schema_version"] == 1
    return out


@pytest.mark.parametrize("side", ["golden", "device"])
def test_diff_refuses_the_old_router_tap_name_and_names_the_new_one(side, tmp_path, capsys):
    old = old_bundle(tmp_path)
    golden, device = (old, ANCHOR) if side == "golden" else (ANCHOR, old)
    assert main(["diff", str(golden), str(device)]) == 2
    err = capsys.readouterr().err.strip()
    assert "'model.layers.0.mlp.gate' is now named 'model.layers.0.mlp.router_logits'" in err and "\n" not in err
    with pytest.raises(FormatError, match="now named 'model.layers.0.mlp.router_logits'"):
        read_dump(device, read_bundle(golden, verify=False))


@pytest.mark.parametrize("command", [["replay", "{old}", "{anchor}", "--layer", "0"],
                                     ["explain", "{old}", "model.layers.0.mlp.experts[0,0,1]"]])
def test_replay_and_explain_refuse_it_too(command, tmp_path, capsys):
    old = old_bundle(tmp_path)
    assert main([a.format(old=old, anchor=ANCHOR) for a in command]) == 2
    assert "is now named 'model.layers.0.mlp.router_logits'" in capsys.readouterr().err


def test_a_mapping_naming_the_old_tap_is_refused(tmp_path, capsys):
    mapping = tmp_path / "mapping.json"
    mapping.write_text(json.dumps({"model.layers.0.mlp.gate": "router_out"}))
    assert main(["diff", str(ANCHOR), str(ANCHOR), "--mapping", str(mapping)]) == 2
    assert "'model.layers.0.mlp.gate' is now named 'model.layers.0.mlp.router_logits'" in capsys.readouterr().err


def test_the_current_names_pass(tmp_path):
    assert main(["diff", str(ANCHOR), str(ANCHOR)]) == 0
