"""Qualcomm AI Hub's own export code (qai-hub-models 0.65.0) as a test oracle for the genie convention.

The Makefile installs qai-hub-models with --no-deps: its package imports pull in the hub client (`qai_hub`,
pydantic configs, AIMET, ONNX), which exporting needs and the graph code does not. So the files are loaded by
path under stand-in packages that skip the package __init__s:

  loaded as they are:   templates/qwen3_5/model_adaptations.py (the Qwen3.5 graph: GDN, gated attention, SHA)
                        templates/qwen3/model_adaptations.py    (the Qwen3 graph: SHA attention, RoPE, conv MLP)
                        templates/llm/{model_adaptations, sha_dynamic_kvcache, common, generator_factory}.py
                        templates/lm_driver/{generator, components}.py, lm_driver/utils/*, lm_schema/components.py
                        templates/qwen3_5/model.py (Qwen3_5Base: forward, input spec, RoPE table), under the stand-in
                        base class below
  run from their source, one definition at a time (their modules import the hub client):
                        templates/llm/model.py: LLMBase.forward, LLMBase.main_input_name, LLMBase._get_input_spec,
                                                LLMBase._get_output_spec, Embedding
                        templates/qwen3/model.py: Qwen3Base.monkey_patch, Qwen3_Optimizations
                        templates/llama3/model.py: RopeEmbedding (Qwen3's cos / sin tables)
  replaced:             torch's `scan` higher-order op in qwen3_5/model_adaptations.py, by torch's eager reference
                        of it (`torch._higher_order_ops.scan._fake_scan`): the op compiles its body with dynamo
  stood in for:         templates/llm/model.py's LLMBase.__init__ (it downloads the checkpoint and tokenizer):
                        `_Base` below sets the attributes the graph code reads; utils/input_spec.TensorSpec (a
                        pydantic config): a (shape, dtype) pair.
  adapted for MoE:      AI Hub exports no Qwen3-MoE: Qwen3Base.monkey_patch is applied to transformers' qwen3_moe
                        module through a view that maps Qwen3* names to Qwen3Moe* (`_Renamed`), and forward_sha gets
                        only the keyword arguments it takes (the MoE layer also passes output_router_logits).
                        Qwen3_5Base.__init__ converts each dense MLP's down_proj to a conv, which an MoE block lacks:
                        for Qwen3.5-MoE the instance is built without that step (SHA attention as __init__ builds it).
  not loaded:           templates/qwen3/model.py's Qwen3Base.forward (it only multiplies the mask by
                        attention_mask_multiplier, 1.0 for float models) and everything that compiles, quantises or
                        talks to the hub.
"""

import ast
import contextlib
import enum
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import types
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VERSION = "0.65.0"
PACKAGES = ["models", "models/templates", "models/templates/llm", "models/templates/lm_driver",
            "models/templates/lm_driver/utils", "models/templates/lm_schema", "models/templates/qwen3",
            "models/templates/qwen3_5", "models/templates/llama3", "utils"]
T = "qai_hub_models.models.templates"


@functools.cache
def root() -> Path:
    """The installed package's directory (find_spec does not run its __init__, which imports the hub client)."""
    try:
        installed = importlib.metadata.version("qai-hub-models")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed != VERSION:
        pytest.fail(f"qai-hub-models=={VERSION} is needed (found {installed}): pip install --no-deps "
                    f"qai-hub-models=={VERSION} (make test installs it)")
    return Path(importlib.util.find_spec("qai_hub_models").submodule_search_locations[0])


def definitions(path: Path, names: list[str], namespace: dict) -> dict:
    """Run the named top-level definitions ("Name" or "Class.method") of a source file in `namespace`, without
    running the rest of the file. Decorators are dropped (the caller re-applies property / staticmethod)."""
    tree = ast.parse(path.read_text())
    top = {node.name: node for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    future = ast.parse("from __future__ import annotations").body
    out = {}
    for name in names:
        cls, _, method = name.rpartition(".")
        node = next(n for n in top[cls].body if getattr(n, "name", None) == method) if cls else top[name]
        if cls:
            node.decorator_list = []
        exec(compile(ast.Module(body=[*future, node], type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
        out[name] = namespace[node.name]
    return out


class _TensorSpec(tuple):
    """utils/input_spec.TensorSpec without pydantic: a (shape, dtype) pair, as AI Hub's code unpacks it."""

    def __new__(cls, shape=None, dtype=None):
        return super().__new__(cls, (shape, dtype))


@functools.cache
def load() -> types.SimpleNamespace:
    """AI Hub's modules and definitions (see the module docstring), once per process."""
    base = root()
    for sub in ("", *PACKAGES):
        name = "qai_hub_models" + ("." + sub.replace("/", ".") if sub else "")
        package = types.ModuleType(name)
        package.__path__ = [str(base / sub)]
        sys.modules[name] = package
    sys.modules["qai_hub_models"].SampleInputsType = dict

    spec = types.ModuleType("qai_hub_models.utils.input_spec")
    spec.InputSpec = spec.OutputSpec = dict
    spec.TensorSpec = _TensorSpec
    sys.modules[spec.__name__] = spec

    common = importlib.import_module(f"{T}.llm.common")
    kvcache = importlib.import_module(f"{T}.llm.sha_dynamic_kvcache")
    llm_source = base / "models/templates/llm/model.py"
    ns = {"torch": torch, "Any": Any, "ABC": __import__("abc").ABC, "abstractmethod": __import__("abc").abstractmethod,
          "DynamicCache": transformers.cache_utils.DynamicCache, "TensorSpec": _TensorSpec, "InputSpec": dict,
          "OutputSpec": dict, **{n: getattr(common, n) for n in ("LLMIOType", "is_native_kv")},
          "SHADynamicCacheNewValueOnly": kvcache.SHADynamicCacheNewValueOnly}
    llm = definitions(llm_source, ["Embedding", "LLMBase.forward", "LLMBase.main_input_name",
                                   "LLMBase._get_input_spec", "LLMBase._get_output_spec"], ns)

    class _Base(torch.nn.Module):
        """Stands in for LLMBase: its __init__ minus the checkpoint / tokenizer downloads, its forward as is."""
        forward = llm["LLMBase.forward"]
        main_input_name = property(llm["LLMBase.main_input_name"])
        _get_input_spec = staticmethod(llm["LLMBase._get_input_spec"])
        _get_output_spec = staticmethod(llm["LLMBase._get_output_spec"])
        llm_io_type = common.LLMIOType.genie_input_ids
        GeneratorClass = None

        def __init__(self, model, sequence_length: int, context_length: int, pad_id: int):
            super().__init__()
            self.model, self.llm_config, self.skip_optimizations = model, model.config, None
            self.sequence_length, self.context_length = sequence_length, context_length
            self.embedding = self.EmbeddingClass(max_length=context_length, config=model.config)
            self.tokenizer = types.SimpleNamespace(eos_token_id=pad_id)   # get_tokenizer: pad = eos

    stub = types.ModuleType(f"{T}.llm.model")
    stub.LLMBase, stub.Embedding, stub.sample_input = _Base, llm["Embedding"], None
    stub.LLM_AIMETOnnx = stub.LLM_QNN = type("Unavailable", (), {})
    stub.DEFAULT_SEQUENCE_LENGTH, stub.DEFAULT_CONTEXT_LENGTH = constants(llm_source, "DEFAULT_SEQUENCE_LENGTH",
                                                                           "DEFAULT_CONTEXT_LENGTH")
    sys.modules[stub.__name__] = stub

    from packaging.version import Version
    from transformers.models.llama import LlamaConfig, modeling_llama
    llama3 = definitions(base / "models/templates/llama3/model.py", ["RopeEmbedding"],
                         {"Embedding": llm["Embedding"], "LlamaConfig": LlamaConfig, "modeling_llama": modeling_llama,
                          "Version": Version, "transformers": transformers, "torch": torch, "Any": Any})
    qwen3 = importlib.import_module(f"{T}.qwen3.model_adaptations")
    from transformers.models.qwen3 import modeling_qwen3
    patch = definitions(base / "models/templates/qwen3/model.py", ["Qwen3_Optimizations", "Qwen3Base.monkey_patch"],
                        {"Enum": enum.Enum, "Any": Any, "torch": torch, "modeling_qwen3": modeling_qwen3,
                         "ORIG_QWEN3_ATTENTION": modeling_qwen3.Qwen3Attention,
                         **{n: getattr(qwen3, n) for n in ("SHAQwen3Attention", "QcQwen3_apply_rotary_pos_emb",
                                                           "QCQwen3MLP", "QCQwen3ForCausalLM")}})
    qwen3_5 = importlib.import_module(f"{T}.qwen3_5.model")
    # torch's scan higher-order op traces its body with dynamo at every new shape (~5 s a call); torch's own eager
    # reference of it (what its tests check the op against) runs the same loop
    from torch._higher_order_ops.scan import _fake_scan
    sys.modules[f"{T}.qwen3_5.model_adaptations"].scan = _fake_scan
    return types.SimpleNamespace(
        Base=_Base, common=common, qwen3=qwen3, Qwen3Rope=llama3["RopeEmbedding"],
        qwen3_monkey_patch=patch["Qwen3Base.monkey_patch"],
        qwen3_5=qwen3_5,
        generator=importlib.import_module(f"{T}.lm_driver.generator"),
        layer_cache=importlib.import_module(f"{T}.lm_driver.utils.layer_cache"),
        factory=importlib.import_module(f"{T}.llm.generator_factory"))


def constants(path: Path, *names: str) -> tuple:
    """Module-level constants as a source file assigns them (literals, or expressions of earlier constants),
    without running the file."""
    values = {}
    for node in ast.parse(path.read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(target, ast.Name) and node.value:
            with contextlib.suppress(Exception):   # other assignments need the file's imports: not constants
                values[target.id] = eval(compile(ast.Expression(node.value), str(path), "eval"),
                                         {"__builtins__": {}}, dict(values))
    return tuple(values[n] for n in names)


class _Renamed:
    """A modeling module seen under Qwen3's names (Qwen3Attention -> Qwen3MoeAttention, ...), so that AI Hub's
    Qwen3 monkey_patch applies to transformers' Qwen3-MoE (which AI Hub does not export)."""

    def __init__(self, module, prefix: str):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_prefix", prefix)

    def _name(self, name: str) -> str:
        return name.replace("Qwen3", self._prefix, 1) if name.startswith("Qwen3") else name

    def __getattr__(self, name):
        return getattr(self._module, self._name(name))

    def __setattr__(self, name, value):
        setattr(self._module, self._name(name), value)


@contextlib.contextmanager
def qwen3_patched(module):
    """AI Hub's Qwen3Base.monkey_patch applied to a transformers modeling module (qwen3 or qwen3_moe) while the
    block runs, undone after it: the patch swaps module-level classes and the rotary embedding's forward, which
    other tests in this process must not see."""
    aihub = load()
    saved = dict(vars(module))
    rotary = next(v for k, v in saved.items() if k.endswith("RotaryEmbedding") and isinstance(v, type))
    forward = rotary.forward
    prefix = rotary.__name__.removesuffix("RotaryEmbedding")
    view = module if prefix == "Qwen3" else _Renamed(module, prefix)
    namespace = aihub.qwen3_monkey_patch.__globals__
    namespace["modeling_qwen3"], original = view, namespace["modeling_qwen3"]
    try:
        aihub.qwen3_monkey_patch(None)
        yield
    finally:
        namespace["modeling_qwen3"] = original
        rotary.forward = forward
        if "_original_forward" in vars(rotary):
            delattr(rotary, "_original_forward")
        for name in list(vars(module)):
            if name not in saved:
                delattr(module, name)
        vars(module).update(saved)


class Qwen3Graph:
    """AI Hub's Qwen3 graph (SHA attention, q pre-scaled, half-width RoPE tables as inputs, new-only KV outputs)
    around a transformers Qwen3 / Qwen3-MoE model: LLMBase.forward on the monkey-patched model."""

    def __init__(self, directory, CL: int, pad_id: int):
        aihub = load()
        config = transformers.AutoConfig.from_pretrained(directory)
        cls = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        self.module = sys.modules[cls.__module__]
        kwargs = {"experts_implementation": "eager"} if getattr(config, "num_experts", None) else {}
        with qwen3_patched(self.module):
            hf = cls.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager", **kwargs).eval()
            for _, module in hf.named_modules():   # as LLMBase.__init__ does
                if hasattr(module, "prepare_conv"):
                    module.prepare_conv()
                if hasattr(module, "prepare_sha"):
                    module.prepare_sha()
        for module in hf.modules():   # the MoE decoder layer passes output_router_logits on; forward_sha takes none
            if isinstance(module, aihub.qwen3.SHAQwen3Attention):
                accepted = set(inspect.signature(module.forward_sha).parameters)
                module.forward = functools.partial(_accepted_only, module.forward_sha, accepted)
        module = self.module

        def forward(model, *inputs):   # the patch's rotary bypass must be in place while the model runs
            with qwen3_patched(module):
                return aihub.Base.forward(model, *inputs)
        base = type("Qwen3Base", (aihub.Base,), {"EmbeddingClass": aihub.Qwen3Rope, "forward": forward})
        self.model, self.CL = base(hf, None, CL, pad_id), CL
        self.output_names = list(self.model._get_output_spec(hf.config.num_hidden_layers))

    def input_spec(self, AR: int) -> dict:
        """{name: (shape, dtype)} of the exported graph with AR token slots, in its input order."""
        cfg = self.model.llm_config
        return self.model._get_input_spec(cfg.num_hidden_layers, AR, self.CL, cfg.hidden_size,
                                          cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim)

    def __call__(self, *inputs):
        with torch.no_grad():
            return self.model(*inputs)


def _accepted_only(forward, accepted, *args, **kwargs):
    return forward(*args, **{k: v for k, v in kwargs.items() if k in accepted})


class Qwen3_5Graph:
    """AI Hub's Qwen3.5 graph (templates/qwen3_5: Qwen3_5Base.forward with SHA attention) around a transformers
    Qwen3.5 / Qwen3.5-MoE model."""

    def __init__(self, directory, CL: int, pad_id: int):
        aihub = load()
        m = aihub.qwen3_5
        config = transformers.AutoConfig.from_pretrained(directory)
        kwargs = {"experts_implementation": "eager"} if getattr(config, "num_experts", None) else {}
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                               attn_implementation="eager", **kwargs).eval()
        if kwargs:   # Qwen3_5Base.__init__ converts each dense MLP's down_proj to a 1x1 conv; an MoE block has none
            self.model = m.Qwen3_5Base.__new__(m.Qwen3_5Base)
            aihub.Base.__init__(self.model, hf, None, CL, pad_id)
            self.model.sha_attention = torch.nn.ModuleDict({
                str(d.layer_idx): m.SHAFullAttention(hf.model.layers[d.layer_idx].self_attn)
                for d in self.model.layer_cache_descriptors if d.attention_type != m.AttentionType.LINEAR})
        else:
            self.model = m.Qwen3_5Base(hf, None, CL, pad_id)
        self.CL, self.output_names = CL, list(self.model.get_output_spec())

    def input_spec(self, AR: int) -> dict:
        """{name: (shape, dtype)} of the exported graph with AR token slots, in its input order."""
        return self.model.get_input_spec(sequence_length=AR, context_length=self.CL)

    def __call__(self, *inputs):
        with torch.no_grad():
            return self.model(*inputs)


def graph(directory, CL: int, pad_id: int):
    """AI Hub's graph for the checkpoint's architecture at context length CL (any sequence length)."""
    model_type = transformers.AutoConfig.from_pretrained(directory).model_type
    return (Qwen3_5Graph if model_type.startswith("qwen3_5") else Qwen3Graph)(directory, CL, pad_id)
