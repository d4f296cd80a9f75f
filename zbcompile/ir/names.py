"""Names of values: the stage IR's local names (`param:fqn`, `act:h`, `saved:3`, see zbcompile.ir.stages) and
the rank program's handles, each with one `Role`. Every pass asks `role_of(name) is Role.X` here instead of
testing string prefixes itself; `key_of` strips the role's prefix (`act:h` -> `h`, `param:w` -> `w`).
"""

from __future__ import annotations

import enum

__all__ = ["Role", "role_of", "key_of", "primal_of", "VOCAB_X", "VOCAB_EMB", "VOCAB_WHOLE", "is_vocab_boundary"]

# With vocabulary parallelism (passes/shard_vocab.py) the first stage receives the summed embedding and the last
# stage sends the output layer's input, each through a collective over all ranks instead of a neighbour's P2P.
# They are act: names (so the split differentiates through them as through any boundary); no fx node name has
# a dot, so they cannot collide with a boundary the partition names.
VOCAB_EMB = "act:vocab.emb"
VOCAB_X = "act:vocab.x"
# A vocabulary parameter gathered whole from every rank's rows, `vocab:whole:<fqn>` ([shards, rows, ...]), for a
# forward that returns the model's logits (passes/forward_only.py, output_graph)
VOCAB_WHOLE = "vocab:whole:"


class Role(enum.Enum):
    """What a value is. The stage-IR roles (zbcompile.ir.stages) come first; their prefix is the `local` name's."""

    PARAM = "param:"          # a parameter (program input)
    BUFFER = "buffer:"        # a buffer: its live value (input) or, as an F output, its new value
    DATA = "data:"            # a microbatch of a flat user argument
    ACT = "act:"              # a boundary activation
    SAVED = "saved:"          # what F saves for the backward
    WSAVED = "wsaved:"        # what B leaves for W
    GRAD_ACT = "grad:act:"    # a boundary activation's gradient
    GRAD_PARAM = "grad:param:"  # a parameter's gradient (per microbatch, or a sum: see Value.scope)
    GRAD_LOSS = "grad:loss"   # the loss's seed gradient
    LOSS = "loss"             # a microbatch's loss, or the program's loss sum
    OUTPUT = "out:"           # a leaf of the model's outputs (a forward that returns them, not the loss)
    VOCAB = "vocab:"          # a value of the vocabulary layers (passes/shard_vocab.py)
    HANDLE = "h:"             # a P2P handle
    OTHER = ""                # anything else (a later pass's own values)

    @property
    def is_activation_memory(self) -> bool:
        """Memory the step allocates per microbatch and frees after its last use."""
        return self in _ACTIVATION


_ACTIVATION = frozenset({Role.ACT, Role.SAVED, Role.WSAVED, Role.GRAD_ACT, Role.VOCAB})
# longest prefix first: grad:act: before act:
_PREFIXES = tuple(sorted((r for r in Role if r.value), key=lambda r: -len(r.value)))
_ROLES: dict[str, Role] = {}
_PREFIX_TEXT = tuple((r, r.value) for r in _PREFIXES)   # Enum.value is a descriptor call: read it once


def role_of(local: str) -> Role:
    """The role of a local name (`saved:3` -> SAVED, `grad:act:h` -> GRAD_ACT); memoized."""
    role = _ROLES.get(local)
    if role is None:
        role = _ROLES[local] = next((r for r, prefix in _PREFIX_TEXT if local.startswith(prefix)
                                     and (prefix.endswith(":") or local == prefix)), Role.OTHER)
    return role


def key_of(local: str) -> str:
    """`local` without its role's prefix: the fqn of `param:fqn` or `grad:param:fqn`, `h` of `act:h`."""
    return local[len(role_of(local).value):]


def primal_of(grad: str) -> str:
    """The value a gradient's name is the gradient of: `grad:act:h` -> `act:h`, `grad:param:w` -> `param:w`."""
    if role_of(grad) not in (Role.GRAD_ACT, Role.GRAD_PARAM):
        raise ValueError(f"{grad!r} is not the name of an activation's or a parameter's gradient")
    return grad[len("grad:"):]


def is_vocab_boundary(name: str) -> bool:
    """Whether `name` (or its gradient's name) is one of the vocabulary layers' boundaries, VOCAB_EMB / VOCAB_X."""
    return name in _VOCAB_BOUNDARIES


_VOCAB_BOUNDARIES = frozenset({VOCAB_EMB, VOCAB_X, "grad:" + VOCAB_EMB, "grad:" + VOCAB_X})
