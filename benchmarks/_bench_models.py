"""Models and partitions for benchmarks/bench_pp.py.

Both sides (torch.distributed.pipelining and zbcompile) run the same weights: every process builds the whole
model from one seed, then takes the pieces it needs.

* "gpt": zbcompile.examples.gpt.GPT (tied wte / lm_head).
* "null": a near-zero-compute model for per-action host overhead: an Embedding, a ModuleList of tiny
  residual Linear units and a Linear head. Residual adds keep each unit's output from being a view
  (torch's stage_backward_input calls detach_() on stage outputs, which fails on views).

Torch stage modules (`TorchStage`) are built from the model's own pieces. torch.distributed.pipelining
cannot share a Parameter between stages on different ranks, so the last stage gets its own *copy* of the
tied wte weight as lm_head: the forward (and so the loss) is identical, but torch's wte / lm_head gradients
are not summed across stages (a correctness gap of torch's, irrelevant to timing).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from zbcompile.examples.gpt import GPT, GPTConfig


# ---- models ---------------------------------------------------------------------------------------
class NullUnit(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x)


class NullNet(nn.Module):
    """Embedding -> `layers` residual Linear units -> Linear head. Compute is ~0 at d=4, seq=1."""

    def __init__(self, vocab: int, d: int, layers: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(NullUnit(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build_model(cfg: dict) -> nn.Module:
    torch.manual_seed(cfg["seed"])
    if cfg["model"] == "null":
        return NullNet(cfg["vocab"], cfg["d"], cfg["layers"])
    return GPT(GPTConfig(vocab=cfg["vocab"], seq=cfg["seq"], d=cfg["d"], heads=cfg["heads"],
                         layers=cfg["layers"], dropout=0.0))


def make_batch(cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg["seed"] + 777)
    b = cfg["mbs"] * cfg["n_mb"]
    x = torch.randint(0, cfg["vocab"], (b, cfg["seq"]), generator=g)
    y = torch.randint(0, cfg["vocab"], (b, cfg["seq"]), generator=g)
    return x, y


# ---- units and partitions ---------------------------------------------------------------------------
def unit_names(cfg: dict) -> list[str]:
    return ["embed"] + [f"b{i}" for i in range(cfg["layers"])] + ["head"]


def unit_cost(cfg: dict, name: str) -> float:
    """Forward FLOP proxy per token (the fwd+bwd ratio is the same for every unit)."""
    d, t, v = cfg["d"], cfg["seq"], cfg["vocab"]
    if cfg["model"] == "null":
        return 1.0
    if name == "embed":
        return 4.0 * d
    if name == "head":
        return 2.0 * d * v + 10.0 * v
    return 24.0 * d * d + 4.0 * t * d


def stage_to_rank(world: int, stages: int, style: str) -> list[int]:
    """'loop': stage s on rank s % world; 'v': ranks 0..w-1 then w-1..0 (V shape)."""
    if style == "loop":
        return [s % world for s in range(stages)]
    out = []
    for s in range(stages):
        c, i = divmod(s, world)
        out.append(i if c % 2 == 0 else world - 1 - i)
    return out


def partition(cfg: dict, stages: int, mapping: list[int]) -> list[list[str]]:
    """Contiguous units per stage, minimising (max per-rank load, max per-stage load); exhaustive (tiny n)."""
    names = unit_names(cfg)
    if cfg["model"] == "null" or cfg.get("split") == "even":
        blocks = names[1:-1]
        per = [len(blocks) // stages + (i < len(blocks) % stages) for i in range(stages)]
        out, k = [], 0
        for n in per:
            out.append(blocks[k:k + n])
            k += n
        out[0].insert(0, "embed")
        out[-1].append("head")
        return out
    cost = [unit_cost(cfg, n) for n in names]
    best = None
    for cuts in itertools.combinations(range(1, len(names)), stages - 1):
        b = (0,) + cuts + (len(names),)
        st = [sum(cost[b[i]:b[i + 1]]) for i in range(stages)]
        rk: dict[int, float] = {}
        for i, c in enumerate(st):
            rk[mapping[i]] = rk.get(mapping[i], 0.0) + c
        key = (round(max(rk.values()), 6), round(max(st), 6), b)
        if best is None or key < best:
            best = key
    b = best[2]
    return [names[b[i]:b[i + 1]] for i in range(stages)]


def split_points(parts: list[list[str]]) -> list[str]:
    """Module fqns at which zbcompile should cut (the first block of each stage after the first)."""
    out = []
    for p in parts[1:]:
        first = p[0]
        out.append(f"blocks.{first[1:]}" if first.startswith("b") else ("ln_f" if first == "head" else first))
    return out


def describe(parts: list[list[str]]) -> str:
    return " | ".join(p[0] if len(p) == 1 else f"{p[0]}..{p[-1]}" for p in parts)


# ---- torch stage modules ---------------------------------------------------------------------------
class TorchStage(nn.Module):
    """The model's pieces for one stage (embedding and/or blocks and/or head), run in order."""

    def __init__(self, model: nn.Module, units: list[str], null: bool) -> None:
        super().__init__()
        self.null = null
        self.has_embed = units[0] == "embed"
        self.has_head = units[-1] == "head"
        if self.has_embed:
            self.wte = model.wte
            if not null:
                self.wpe = model.wpe
        self.blocks = nn.ModuleList(model.blocks[int(u[1:])] for u in units if u.startswith("b"))
        if self.has_head:
            if null:
                self.head = model.head
            else:
                self.ln_f = model.ln_f
                self.lm_head = nn.Linear(model.wte.weight.shape[1], model.wte.weight.shape[0], bias=False)
                with torch.no_grad():  # tied weight: a copy (torch cannot share it across stages)
                    self.lm_head.weight.copy_(model.wte.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_embed:
            if self.null:
                x = self.wte(x)
            else:
                x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for b in self.blocks:
            x = b(x)
        if self.has_head:
            x = self.head(x) if self.null else self.lm_head(self.ln_f(x))
        return x
