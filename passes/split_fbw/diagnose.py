"""SplitError's text when aot autograd cannot trace a stage's joint: the stage, the module and the node the error
points at (with a window of the graph), torch's whole message, and a fix."""

from __future__ import annotations

from typing import Sequence

from torch import fx

from zbcompile._torch_private import OpOverload
from zbcompile.ir.stages import Graph, module_path
from zbcompile.passes.analysis.aliases import graph_output_aliases

__all__ = ["_explain_joint_failure"]


def _explain_joint_failure(stage: Graph, diff_gm: fx.GraphModule, exc: BaseException) -> str:
    """SplitError's text when aot cannot trace the stage's joint: where (stage, module, node with a window of
    the graph), what (torch's whole message) and how to fix it."""
    text = f"{type(exc).__name__}: {exc}".strip()
    culprits = _culprits(diff_gm, text)
    head = (f"stage {stage.index} ({', '.join(stage.modules) or 'no whole module'}) could not be differentiated: "
            "aot autograd's joint trace of its forward failed")
    lines = [head]
    if culprits:
        node = culprits[0]
        paths = [p for p in module_path(node) if p]
        where = f" in module `{paths[-1]}`" if paths else ""
        lines.append(f"at node `{node.name}` ({node.target}){where}:")
        lines.append(_window(diff_gm, node))
    else:
        lines.append("the error names no node of the stage graph; the stage forward begins:")
        lines.append(_window(diff_gm, None))
    lines.append("torch said:")
    lines += ["    " + line for line in text.splitlines()]
    lines.append(_fix(text, culprits))
    return "\n".join(lines)


def _culprits(gm: fx.GraphModule, text: str) -> list[fx.Node]:
    """Nodes of `gm` the error points at: outputs that alias an input when it complains about aliasing, else the
    nodes whose op it names (`mylib.op.default` or `mylib::op`)."""
    outs = gm.graph.output_node().args[0]
    aliasing = [n for n, roots in zip(outs, graph_output_aliases(gm)) if roots]
    if "alias" in text and aliasing:
        return aliasing
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, OpOverload)
            and (str(n.target) in text or n.target.name() in text)]


def _window(gm: fx.GraphModule, mark: fx.Node | None, width: int = 4) -> str:
    """The graph's nodes around `mark` (marked `>>`), or its first nodes when there is none."""
    nodes = [n for n in gm.graph.nodes if n.op != "placeholder"]
    at = nodes.index(mark) if mark in nodes else 0
    lo, hi = max(0, at - width), min(len(nodes), at + width + 1)
    shown = [f"  {'>>' if n is mark else '  '} {n.format_node()}"[:200] for n in nodes[lo:hi]]
    return "\n".join(shown)


def _fix(text: str, culprits: Sequence[fx.Node]) -> str:
    if "alias" in text:
        return ("fix: a stage may not return its input or a view of it; return a copy (`.clone()`) of the value "
                "that crosses the cut, or move the split point so that the view stays inside one stage")
    if "autograd" in text and culprits:
        return (f"fix: give `{culprits[0].target}` a backward (torch.library.register_autograd for a custom op), "
                "or compute it outside the model")
    return ("fix: every op in a stage must be traceable by aot autograd with a backward; replace or move the op "
            "above, or choose other split_points to isolate it")
