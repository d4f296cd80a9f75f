"""One optimizer step undone: post-validation's rollback (zbcompile/post_validation.py), from a Snapshot
(`post_validate=True`) or in closed form without one (`post_validate="inverse"`), and the hyperparameters the
update ran under put back for its redo (`in_force`).

The snapshot rollback keeps a copy of the parameters and the optimizer state from the optimistic update to the
verdict (three times the parameters with AdamW). The reference instead inverts the update from the state after
it and the gradient it used, which stays until the verdict anyway:

    AdamW / Adam   p += lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps);  p /= 1 - lr * wd  (decoupled decay)
                   m = (m - (1 - b1) g) / b1;  v = (v - (1 - b2) g^2) / b2;  step -= 1
    SGD            p = p + lr * buf (or its nesterov / no-momentum form, the weight decay solved for)
                   buf = (buf - (1 - dampening) (g + wd p)) / momentum

Each line is the step's own arithmetic run backwards, so the parameters come back to within a few units in the
last place, not bit for bit: in float64 the training then follows the synchronous step to about 1e-13, in
float32 to about 1e-6 (tests/e2e/test_post_validation.py). A state the step created (its first) is dropped
again, exactly. Supported: torch.optim.AdamW, Adam without weight decay or with decoupled decay (AdamW's), and
SGD; without amsgrad (a running maximum has no inverse). Anything else raises UsageError: use the snapshot.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch

from zbcompile.errors import UsageError
from zbcompile.grads import local

__all__ = ["Inverse", "Snapshot", "check_invertible", "hyperparameters", "in_force", "state_marks", "state_change"]


def check_invertible(optimizer: torch.optim.Optimizer) -> None:
    """UsageError where `optimizer`'s step has no closed-form inverse here."""
    kind = _kind(optimizer)
    why = None
    if kind is None:
        why = (f"{type(optimizer).__name__} has no closed-form inverse here (torch's AdamW, Adam and SGD have; "
               "a subclass of them may step differently)")
    for group in optimizer.param_groups:
        if why is None and group.get("amsgrad"):
            why = "amsgrad keeps a running maximum, which has no inverse"
        elif why is None and kind == "adam" and group["weight_decay"] and not _decoupled(optimizer, group):
            why = "Adam's coupled weight decay (added to the gradient) is not inverted; AdamW's decoupled one is"
        elif why is None and kind == "sgd" and group["momentum"] == 0 and group["dampening"]:
            why = "SGD with dampening but no momentum"
    if why is not None:
        raise UsageError(f"post_validate='inverse': {why}; use post_validate=True (a snapshot, any optimizer)")


def _kind(optimizer) -> str | None:
    """The closed form that inverts `optimizer`'s step: torch's own classes only, not a subclass, whose step
    may do anything more (a decay after SGD's update)."""
    return {torch.optim.Adam: "adam", torch.optim.AdamW: "adam", torch.optim.SGD: "sgd"}.get(type(optimizer))


def _decoupled(optimizer, group) -> bool:
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))


class Inverse:
    """Undo the optimizer's next step: `before_step()` notes which parameters have no state yet (their first
    step creates it), `undo()` runs the step backwards from the state after it and each parameter's .grad, with
    the hyperparameters the param_groups hold then: the caller puts back those the step ran with (an LR
    scheduler may have changed them since; post_validation._in_force)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        check_invertible(optimizer)
        self.optimizer, self.kind = optimizer, _kind(optimizer)
        self._fresh: set[torch.Tensor] = set()

    def before_step(self) -> None:
        state = self.optimizer.state
        key = "exp_avg" if self.kind == "adam" else "momentum_buffer"
        self._fresh = {p for g in self.optimizer.param_groups for p in g["params"]
                       if p.grad is not None and key not in state.get(p, {})}

    @torch.no_grad()
    def undo(self) -> None:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = local(p.grad)
                g = -g if group.get("maximize") else g
                if self.kind == "adam":
                    self._adam(p, g, group)
                else:
                    self._sgd(p, g, group)

    def _adam(self, p, g, group) -> None:
        state = self.optimizer.state[p]
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        step = float(state["step"])
        m, v, x = local(state["exp_avg"]), local(state["exp_avg_sq"]), local(p)
        denom = (v.sqrt() / math.sqrt(1 - b2 ** step)).add_(eps)
        # a tensor lr in the step's own precision (a float32 lr rounds lr / bc1 and 1 - lr * wd there)
        x.addcdiv_(m, denom, value=float(lr / (1 - b1 ** step)))
        if wd and _decoupled(self.optimizer, group):
            x.div_(1 - lr * wd)
        if p in self._fresh:   # the step made the state: none again
            del self.optimizer.state[p]
            return
        m.sub_(g, alpha=1 - b1).div_(b1)
        v.addcmul_(g, g, value=-(1 - b2)).div_(b2)
        if isinstance(state["step"], torch.Tensor):
            state["step"].sub_(1)
        else:
            state["step"] = step - 1

    def _sgd(self, p, g, group) -> None:
        lr, mu, damp, wd = float(group["lr"]), group["momentum"], group["dampening"], group["weight_decay"]
        x = local(p)
        if mu == 0:   # p' = p - lr (g + wd p)
            x.add_(g, alpha=lr).div_(1 - lr * wd)
            return
        state = self.optimizer.state[p]
        buf = local(state["momentum_buffer"])
        if group["nesterov"]:   # p' = p - lr (g + wd p + mu buf')
            x.add_(g, alpha=lr).add_(buf, alpha=lr * mu).div_(1 - lr * wd)
        else:                   # p' = p - lr buf'
            x.add_(buf, alpha=lr)
        if p in self._fresh:    # the first step set buf' = g + wd p: none again
            del state["momentum_buffer"]
            return
        buf.sub_(g + wd * x if wd else g, alpha=1 - damp).div_(mu)


class Snapshot:
    """What optimizer.step() changes, copied before it (post_validate=True): the parameters and their tensor
    state, the state's other values, and a hand-written optimizer's own counters (`self.t += 1` in its step:
    its public plain attributes). Freed at the verdict, so the plan holds it until VALIDATE only (memory_plan)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        state = optimizer.state
        self.keys = [(p, k) for p in self.params if p in state for k, v in state[p].items()
                     if isinstance(v, torch.Tensor)]
        sources = [local(p.detach()) for p in self.params] + [local(state[p][k]) for p, k in self.keys]
        self.kept = [t.clone() for t in sources]
        self.others = {p: {k: copy.deepcopy(v) for k, v in state[p].items() if not isinstance(v, torch.Tensor)}
                       for p in self.params if p in state}
        self.own = {k: copy.deepcopy(v) for k, v in vars(optimizer).items()
                    if not k.startswith("_") and isinstance(v, (int, float, bool, str, tuple, type(None)))}
        self.nbytes = sum(t.numel() * t.element_size() for t in self.kept)

    def restore(self) -> None:
        """The optimizer and the parameters as they were: a state the update made (its first, or a key it
        added) is dropped again."""
        state = self.optimizer.state
        for p in self.params:
            if p not in self.others:   # no state before this update (its first): none after the rollback
                state.pop(p, None)
        live = [local(p.detach()) for p in self.params] + [local(state[p][k]) for p, k in self.keys]
        with torch.no_grad():
            torch._foreach_copy_(live, self.kept)
        had = set(self.keys)
        for p, values in self.others.items():
            for k in [k for k in state[p] if k not in values and (p, k) not in had]:   # made by this update
                del state[p][k]
            state[p].update(values)
        vars(self.optimizer).update(self.own)


# ---- the state a rollback writes over -----------------------------------------------------------------------
def state_marks(optimizer: torch.optim.Optimizer) -> tuple:
    """The optimizer's state as it is now, for `state_change`: the state mapping, how many entries hold
    something, and for each parameter with state its entry, the entry's values and each tensor's version."""
    state = optimizer.state
    entries = [(p, state[p], [(k, v, local(v)._version if isinstance(v, torch.Tensor) else None)
                              for k, v in state[p].items()])
               for group in optimizer.param_groups for p in group["params"] if state.get(p)]
    return state, _filled(state), entries


def state_change(optimizer: torch.optim.Optimizer, marks: tuple) -> torch.Tensor | str | None:
    """What changed in the optimizer's state since `marks`: "state" (the mapping replaced, or an entry added),
    the first parameter whose entry was replaced, emptied, rebound or changed in place, or None."""
    state, size, entries = marks
    if optimizer.state is not state or _filled(state) > size:
        return "state"
    for p, entry, values in entries:
        if state.get(p) is not entry or len(entry) != len(values):
            return p
        for k, v, version in values:
            if entry.get(k, _MISSING) is not v and not _same(entry.get(k), v):
                return p
            if version is not None and local(v)._version != version:
                return p
    return None


def _filled(state) -> int:
    """How many parameters have state (`opt.state[p]` read for one without any adds an empty entry: no change)."""
    return sum(1 for entry in state.values() if entry)


# ---- the hyperparameters an update ran under ----------------------------------------------------------------
def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """A copy of each param_group's entries but its parameters: what an LR scheduler (or the user) may change
    before the verdict, lr and, with OneCycleLR / CyclicLR, momentum or betas. The user's loop steps the
    scheduler right after step(), so a rank that redoes the update at the next step's deadline would otherwise
    use the next step's values, and rank p-1 (which updated at once) this step's."""
    return [copy.deepcopy({k: v for k, v in group.items() if k != "params"}) for group in optimizer.param_groups]


@contextlib.contextmanager
def in_force(optimizer: torch.optim.Optimizer, kept: list[dict], after: list[dict]):
    """The optimizer as it was for the update (`kept`: its groups' entries before it; the groups added since
    left out) while the block undoes or redoes that update. Afterwards each group holds, for each entry, what
    the user (a scheduler) has set since the update (`after`: the entries right after it), the very object (a
    scheduler that fills a tensor lr in place keeps its tensor); an entry the user has not touched holds the
    redo's value (an optimizer counting its steps in a group entry, as Prodigy does). No scheduler's state
    (last_epoch, _last_lr) is touched."""
    groups = optimizer.param_groups
    current = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    held = [dict(entries) for entries in kept]
    for group, entries in zip(groups, held):
        for k in [k for k in group if k != "params" and k not in entries]:   # written first by the update
            del group[k]
        group.update(entries)
    optimizer.param_groups = groups[:len(kept)]   # a group added since (add_param_group) took no part in it
    try:
        yield
    finally:
        optimizer.param_groups = groups
        for group, now, entries, then in zip(groups, current, held, after):
            for k, v in now.items():
                if k not in then or not _same(v, then[k]):   # set since the update: the user's
                    group[k] = v
                elif group.get(k, _MISSING) is entries.get(k, _MISSING):   # the redo did not rebind it
                    if isinstance(v, torch.Tensor) and v is not group[k]:
                        with torch.no_grad():
                            v.copy_(group[k])   # (the redo changed it in place: its value, in the user's tensor)
                    group[k] = v


_MISSING = object()


def _same(a, b) -> bool:
    """Whether two group entries hold the same value (tensors by value; anything else by ==, or identity)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a.detach().cpu(), b.detach().cpu())))
    try:
        return a is b or bool(a == b)
    except Exception:   # a value without a plain == (an array): a change unless it is the very object
        return False
