"""What the trace pass says when torch.export cannot capture the training step, or captures one a pipeline
cannot run: the module on the failing stack, data-dependent control flow (and the BatchNorm whose cumulative
average causes it), a tensor made outside the trace, an output export cannot describe, an in-place write into a
model input or a parameter. Each message names where and what to do (TraceError's text, passes/trace.py).
"""

from __future__ import annotations

import traceback
from typing import Callable

from torch import fx, nn
from torch.export.graph_signature import OutputKind

from zbcompile.ir.stages import module_path

__all__ = ["explain_export_failure", "explain_mutation", "signature_problem"]


def signature_problem(exc: Exception) -> str:
    """Why export could not keep the model's call signature, for the user who asks for the model's outputs."""
    said = " ".join(str(exc).split())
    said = said if len(said) <= 300 else said[:300] + " ..."
    if "pytree flattened" in said:
        return ("the model returns an object torch.utils._pytree does not know (a dataclass or a class of your own)"
                "; register its class before compile with torch.export.register_dataclass(cls) (a dataclass) or "
                f"torch.utils._pytree.register_pytree_node (torch: {said})")
    if "does not exist in the graph" in said:   # the decompositions dropped an output the loss never reads
        return ("the loss does not read every output of the model (one is made by an op the traced step drops, "
                "since nothing reads it), so the traced step never computes it; return only what the loss reads, "
                f"or read every output in loss_fn (torch: {said})")
    return ("the usual cause is an output export cannot describe, such as a HuggingFace model's key-value cache "
            f"(compile it with use_cache=False); torch: {type(exc).__name__}: {said}")


def explain_export_failure(exc: BaseException, model: nn.Module) -> str:
    where = _failing_module(exc, model)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    chain = _exception_chain(exc)
    data_dependent = any(
        "data-dependent" in str(e) or "data dependent" in str(e) or "GuardOnDataDependent" in type(e).__name__
        for e in chain
    )
    cumulative = _cumulative_average_norms(model, where)
    if data_dependent and cumulative:
        return (
            f"data-dependent control flow in {where}: {cumulative} has momentum=None, a cumulative moving "
            "average of its statistics, whose factor 1/num_batches_tracked torch reads as a Python number every "
            "step; the pipeline needs one static graph per stage. Give it a momentum (e.g. 0.1, the default), or "
            "update the statistics outside the training step."
        )
    if data_dependent:
        return (
            f"data-dependent control flow in {where}: {text}\n"
            "The pipeline needs one static graph per stage, so Python `if`/`while`/`.item()` on tensor values "
            "cannot be captured. Compute both sides and select with torch.where (torch.cond is refused too: "
            "the stage graphs are split op by op), or decide outside the model: a Python setting of the model "
            "or loss_fn, fixed before compile (compile again to change it)."
        )
    if "fake tensor in the exported program constant" in text:   # export's words for a tensor it lost track of
        return (f"could not capture the training step ({where}): a tensor was made outside what the trace "
                "records, the usual cause `tensor.data` in forward (write `.detach()`, which the trace keeps); "
                f"torch: {text}")
    return f"could not capture the training step ({where}): {type(exc).__name__}: {text}"


def _cumulative_average_norms(model: nn.Module, where: str) -> str:
    """The normalization module named in `where` that keeps a cumulative average (momentum=None), as
    '`path`', or ''."""
    for name, m in model.named_modules():
        if (f"module `{name}`" in where and getattr(m, "momentum", 0.0) is None
                and getattr(m, "track_running_stats", False) and m.training):
            return f"`{name}` ({type(m).__name__})"
    return ""


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def _failing_module(exc: BaseException, model: nn.Module) -> str:
    """The innermost module of `model` on the failing stack, as 'module `path` (file:line)'."""
    names = {id(m): name for name, m in model.named_modules()}
    found = None
    for e in reversed(_exception_chain(exc)):  # the original error first
        for frame, lineno in traceback.walk_tb(e.__traceback__):
            owner = frame.f_locals.get("self")
            if owner is not None and id(owner) in names and isinstance(owner, nn.Module):
                path = names[id(owner)] or "<root>"
                found = f"module `{path}` ({type(owner).__name__}, {frame.f_code.co_filename}:{lineno})"
        if found:
            return found
    return "the loss function or the model's top level"


def explain_mutation(ep, spec, position: int, strip: Callable[[str], str]) -> str:
    """TraceError's text for a step output torch.export made of an in-place write the pipeline cannot carry:
    into a model input (USER_INPUT_MUTATION) or a parameter (PARAMETER_MUTATION); names the module and op.
    strip: the state's name in the model from its name in the exported wrapper."""
    node = ep.graph.output_node().args[0][position]   # the new value, computed out of place by export
    paths = [p for p in module_path(node) if p] if isinstance(node, fx.Node) else []
    where = f"module `{paths[-1]}`" if paths else "the model's top level or the loss"
    op = f"`{node.target}`" if isinstance(node, fx.Node) else "an in-place op"
    if spec.kind == OutputKind.USER_INPUT_MUTATION:
        what = f"writes into a model input in place ({op} in {where})"
        fix = "work on a copy (`x = x.clone()` before the in-place op, or its out-of-place form)"
    elif spec.kind == OutputKind.PARAMETER_MUTATION:
        what = f"updates parameter `{strip(spec.target)}` in place inside forward ({op} in {where})"
        fix = ("keep forward free of parameter updates: do them between steps (after `step()`, under "
               "torch.no_grad()), or hold the value in a buffer" + (
                   "; for nn.Embedding(max_norm=...), which renormalizes the looked-up rows in place, drop max_norm "
                   "and renormalize the weight after each step (torch.embedding_renorm_ under torch.no_grad())"
                   if "embedding_renorm" in str(op) else ""))
    else:
        what = f"returns an output of kind {spec.kind.name} (`{spec.target}`)"
        fix = "return one loss from loss_fn and keep the model's other state in parameters and buffers"
    return f"the training step {what}, which a pipeline stage cannot carry across microbatches; fix: {fix}"
