"""The token decision after the logits: a specd.SampleTokens node, then a
specd.TokenLogprobs node for the emitted tokens' logprobs (contract: sampling_op)."""

from __future__ import annotations

from typing import Any

import onnx
from onnx import TensorProto, helper

from specd.ort_models.native_ops import DOMAIN
from specd.ort_models.onnx_writer import GraphWriter
from specd.ort_models.sampling_op import (
    GRAPH_INPUTS,
    GRAPH_OUTPUTS,
    INPUTS,
    LOGPROB_INPUTS,
    LOGPROB_OUTPUTS,
    OUTPUTS,
)

from .options import F32, I64

F64 = TensorProto.DOUBLE
I32 = TensorProto.INT32

# the node's inputs after the logits: element type and shape
INPUT_TYPES: dict[str, tuple[int, list[Any]]] = {
    "sample_plan": (I64, ["C", 10]),
    "sample_params": (F64, ["C", 8]),
    "sample_keys": (I64, ["C"]),
    "sample_drafts": (I64, ["C", "D"]),
    "sample_q_ids": (I64, ["C", "D", "K"]),
    "sample_q_probs": (F32, ["C", "D", "K"]),
    "sample_history": (I64, ["C", "H"]),
    "sample_bias_ids": (I64, ["C", "NB"]),
    "sample_bias_values": (F64, ["C", "NB"]),
    "sample_masks": (I32, ["M", "MW"]),
    "sample_logprobs": (I64, ["C"]),
}
OUTPUT_TYPES: dict[str, tuple[int, list[Any]]] = {
    "sampled_tokens": (I64, ["C", "D1"]),
    "sampled_counts": (I64, ["C", 3]),
    "sampled_accept_probs": (F32, ["C", "D"]),
    "sampled_cand_ids": (I64, ["R", "KC"]),
    "sampled_cand_probs": (F32, ["R", "KC"]),
    "sampled_logprobs": (F64, ["C", "D1"]),
    "sampled_top_ids": (I64, ["C", "D1", "NL"]),
    "sampled_top_logprobs": (F64, ["C", "D1", "NL"]),
}


def sample_tokens(g: GraphWriter, logits: str) -> None:
    """Decide tokens from `logits` [R, vocab] in the graph: the nodes with their inputs
    and outputs (graph contract: sampling_op)."""
    for name in GRAPH_INPUTS:
        g.input(name, *INPUT_TYPES[name])
    for node in _nodes(logits):
        g.op(node.op_type, list(node.input), domain=DOMAIN, out=list(node.output))
    for name in GRAPH_OUTPUTS:
        g.output(name, *OUTPUT_TYPES[name])


def _nodes(logits: str) -> list[onnx.NodeProto]:
    """SampleTokens over `logits`, then TokenLogprobs over its decision."""
    return [helper.make_node("SampleTokens", [logits, *INPUTS], list(OUTPUTS), domain=DOMAIN),
            helper.make_node("TokenLogprobs", [logits, "sample_plan", "sampled_tokens",
                                               "sampled_counts", *LOGPROB_INPUTS],
                             list(LOGPROB_OUTPUTS), domain=DOMAIN)]


def sampler_model(vocab: int) -> onnx.ModelProto:
    """A model of the nodes alone over logits [R, vocab] (their tests and benchmarks)."""
    graph = helper.make_graph(
        _nodes("logits"), "sample_tokens",
        [helper.make_tensor_value_info("logits", F32, ["R", vocab])]
        + [helper.make_tensor_value_info(n, *INPUT_TYPES[n]) for n in GRAPH_INPUTS],
        [helper.make_tensor_value_info(n, *OUTPUT_TYPES[n]) for n in GRAPH_OUTPUTS])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 10
    return model
