"""Device I/O conventions: a prompt turned into the fixed-shape graph calls a device makes, with every input
and output named as that toolchain names it (device_conventions.md, docs/conventions.md).

Every convention module (hf, genie, qeff) is the same small protocol:

    Options                                   frozen dataclass of the export's options (the manifest's
                                              convention.params); opts.check(model) raises InputError naming the
                                              allowed values, opts.resolved(model) fills the model-dependent defaults
    input_shapes(cfg, opts) -> dict           name -> shape of a call's graph inputs (sizes as ints or letters)
    graph(model, inputs, opts) -> dict        one call of the device graph: its inputs -> its outputs
    run(model, prompt_ids, opts, decode_steps=0, taps=None, decode_ids=None) -> list[Call]
                                              the host loop: every call's inputs, outputs, taps and valid regions
    io_nodes(cfg, params) -> dict[str, Node]  the producer of every graph input and output (refimpl.graph.Node);
                                              params: the manifest's convention.params ({} or None: the defaults)
    state_input(kind, i) -> str               the graph input of layer i's carried state (past_key, past_value,
                                              conv_state, recurrent_state): what a block's "cache:<kind>.<i>" is
    state_output(kind, i) -> str              the graph output of that state after the call

What several conventions share lives in refimpl.conventions.common.
"""

from . import genie, hf, qeff

CONVENTIONS = {"hf": hf, "genie": genie, "qeff": qeff}
