"""Small models for the split tests: factories returning (model, loss_fn, example, max_stages).

Every factory seeds its own init, so two calls build identical models. `example` is `(inputs, targets)`;
`max_stages` is how many stages the model's cuttable units allow the tests to ask for.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from zbcompile.examples.gpt import GPT, GPTConfig
from zbcompile.examples.gpt import loss_fn as gpt_loss

__all__ = ["Case", "eager_accumulated", "train_sgd", "mlp", "convnet", "gpt", "hf_gpt2", "skipnet", "masknet",
           "HFLogits", "dict_lm", "marked_mlp", "seq2seq", "cast_net", "latent_net", "rope_net", "hf_t5", "keyword_lm"]


def eager_accumulated(model: nn.Module, loss_fn, xb: torch.Tensor, yb: torch.Tensor, m: int) -> float:
    """The pipeline's reference: `model`'s gradients accumulated over m microbatches of (xb, yb), each loss
    scaled by 1/m (the step's loss is their mean, which this returns). Accumulates into model's .grad."""
    loss = 0.0
    for x, y in zip(xb.chunk(m), yb.chunk(m)):
        part = loss_fn(model(x), y) / m
        part.backward()
        loss += part.item()
    return loss


def train_sgd(model: nn.Module, step, batches, lr: float = 0.05) -> tuple[list[float], list[dict]]:
    """One training step per batch: `step(x, y)` (returns the loss), then SGD on model's parameters. Between
    steps .grad is zeroed both ways the optimizer does: set to None before even steps, zeroed in place before odd
    ones. Returns the losses and, per step, a copy of every gradient by parameter name."""
    opt = torch.optim.SGD(list(model.parameters()), lr=lr)
    losses, grads = [], []
    for k, (xb, yb) in enumerate(batches):
        opt.zero_grad(set_to_none=k % 2 == 0)
        losses.append(step(xb, yb))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    return losses, grads


class Case(NamedTuple):
    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    example: tuple
    max_stages: int


def mlp(layers: int = 8, width: int = 16, batch: int = 4) -> Case:
    """Linear/Tanh pairs in one Sequential; mean-squared-error loss."""
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    model = nn.Sequential(*mods)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    return Case(model, F.mse_loss, (x, y), 8)


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class ConvNet(nn.Module):
    """Conv-BN-ReLU blocks, global average pool, linear classifier."""

    def __init__(self, blocks: int = 4, channels: int = 4, classes: int = 5) -> None:
        super().__init__()
        chans = [3] + [channels] * blocks
        self.features = nn.Sequential(*(ConvBlock(a, b) for a, b in zip(chans, chans[1:])))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def convnet(blocks: int = 8, batch: int = 4) -> Case:
    torch.manual_seed(0)
    model = ConvNet(blocks)
    x, y = torch.randn(batch, 3, 8, 8), torch.randint(0, 5, (batch,))
    return Case(model, F.cross_entropy, (x, y), 8)


def gpt(layers: int = 6, dropout: float = 0.0, batch: int = 2, seq: int = 8, device: str | None = None) -> Case:
    """zbcompile.examples.gpt with tied wte / lm_head, tiny sizes."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=16, d=32, heads=2, layers=layers, dropout=dropout)
    with torch.device(device) if device else _nullcontext():
        model = GPT(cfg)
    idx, tgt = torch.randint(0, cfg.vocab, (batch, seq)), torch.randint(0, cfg.vocab, (batch, seq))
    return Case(model, gpt_loss, (idx, tgt), 8)


class HFLogits(nn.Module):
    """A HuggingFace causal LM returning just its logits."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=idx).logits


def hf_gpt2(layers: int = 6, batch: int = 2, seq: int = 8) -> Case:
    """transformers' GPT2LMHeadModel from a tiny random config (no downloads); wte / lm_head tied."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=layers, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = HFLogits(GPT2LMHeadModel(cfg))
    idx, tgt = torch.randint(0, 64, (batch, seq)), torch.randint(0, 64, (batch, seq))
    return Case(model, gpt_loss, (idx, tgt), 8)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class SkipNet(nn.Module):
    """A long skip connection: `h0` is made in the first stage and read again in the last one."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = torch.tanh(self.layers[0](x))
        h = torch.tanh(self.layers[1](h0))
        h = torch.tanh(self.layers[2](h))
        return self.layers[3](h) + h0


def skipnet(batch: int = 4) -> Case:
    torch.manual_seed(0)
    model = SkipNet()
    x, y = torch.randn(batch, 8), torch.randn(batch, 8)
    return Case(model, F.mse_loss, (x, y), 4)


class MaskNet(nn.Module):
    """A bool mask made from the data in the first stage and applied in the last: no grad crosses for it."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](x)
        keep = x > 0
        h = torch.tanh(self.layers[1](h))
        return self.layers[2](h) * keep


def masknet(batch: int = 4) -> Case:
    torch.manual_seed(0)
    x, y = torch.randn(batch, 8), torch.randn(batch, 8)
    return Case(MaskNet(), F.mse_loss, (x, y), 3)


class _DictBlock(nn.Module):
    """A pre-norm residual block: norm, a two-layer MLP, residual add."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class DictLM(nn.Module):
    """torchtitan's layout: blocks in an nn.ModuleDict keyed "0".."n-1", looped over `.values()`."""

    def __init__(self, layers: int = 6, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleDict({str(i): _DictBlock(d) for i in range(layers)})
        self.norm = nn.LayerNorm(d)
        self.output = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(idx)
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h))


def dict_lm(layers: int = 6, batch: int = 2, seq: int = 8) -> Case:
    torch.manual_seed(0)
    model = DictLM(layers)
    idx, tgt = torch.randint(0, 32, (batch, seq)), torch.randint(0, 32, (batch, seq))
    return Case(model, gpt_loss, (idx, tgt), layers)


class MarkedMLP(nn.Module):
    """Blocks held as plain attributes (no container), with torch.distributed.pipelining's `pipe_split()`
    markers between them: the markers are the split points."""

    def __init__(self, width: int = 8, marks: tuple[int, ...] = (1, 3)) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.mid = nn.Linear(width, width)
        self.deep = nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.marks = marks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.pipelining import pipe_split

        for i, layer in enumerate((self.inp, self.mid, self.deep, self.out)):
            x = torch.tanh(layer(x))
            if i in self.marks:
                pipe_split()
        return x


def marked_mlp(marks: tuple[int, ...] = (0, 2), batch: int = 4) -> Case:
    """MarkedMLP with a marker after the layers in `marks` (len(marks) + 1 stages)."""
    torch.manual_seed(0)
    x, y = torch.randn(batch, 8), torch.randn(batch, 8)
    return Case(MarkedMLP(marks=marks), F.mse_loss, (x, y), len(marks) + 1)


class _Attention(nn.Module):
    """Multi-head attention over SDPA, written as T5 is: `transpose(1, 2).contiguous().view(...)` after SDPA,
    whose `.contiguous()` export drops (its traced SDPA output is already laid out [B, T, H, D])."""

    def __init__(self, d: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.bias = nn.Parameter(0.1 * torch.randn(heads, 1, 1))   # a learned position bias, as T5's

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (f(z).view(b, -1, self.heads, d // self.heads).transpose(1, 2)   # [b, h, t, d/h]
                   for f, z in ((self.q, x), (self.k, memory), (self.v, memory)))
        mask = self.bias.expand(b, -1, t, k.shape[2]).clone()                      # [b, h, t, s]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return self.o(y.transpose(1, 2).contiguous().view(b, t, d))


class _EncoderLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn, self.norm = _Attention(d), nn.LayerNorm(d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.attn(self.norm(h), self.norm(h))


class _Transposer(nn.Module):
    """Hands the next module its output permuted ([b, d, t], a non-contiguous view), as conv-fronted or
    channels-first encoders do; the next module transposes it back and flattens it with `.view`."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h).transpose(1, 2)


class _Untransposer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, d, t = h.shape
        return self.proj(h.transpose(1, 2).reshape(b * t, d).view(b, t, d))


class Seq2Seq(nn.Module):
    """An encoder-decoder: ids and decoder ids (two model inputs); a permuted view crosses from `encoder.1` to
    `encoder.2`; the decoder's cross-attention reads the encoder output."""

    def __init__(self, vocab: int = 32, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.encoder = nn.ModuleList([_EncoderLayer(d), _Transposer(d), _Untransposer(d), _EncoderLayer(d)])
        self.decoder = nn.ModuleList([_Attention(d), _Attention(d)])
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, dec_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.encoder:
            h = layer(h)
        y = self.embed(dec_ids)
        for layer in self.decoder:
            y = y + layer(y, h)
        return self.head(y)


def seq2seq(batch: int = 2, seq: int = 8) -> Case:
    torch.manual_seed(0)
    ids, dec, tgt = (torch.randint(0, 32, (batch, seq)) for _ in range(3))
    return Case(Seq2Seq(), gpt_loss, ((ids, dec), (tgt,)), 6)


class _Cast(nn.Module):
    """Returns its input: `.to(float32)` of a float32 tensor computes nothing (export keeps only a metadata
    assertion), as encoders' dtype casts of the hidden states do."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.to(torch.float32)


class _Heads(nn.Module):
    """Returns a view of its input: [b, d] -> [b, 2, d/2]."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.view(h.shape[0], 2, -1)


class CastNet(nn.Module):
    """Stages that return their input (`cast`) or a view of it (`heads`) when cut before and after them."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.cast = _Cast()
        self.heads = _Heads()
        self.out = nn.Linear(width // 2, width // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.heads(self.cast(torch.tanh(self.inp(x))))).flatten(1)


def cast_net(batch: int = 4) -> Case:
    torch.manual_seed(0)
    x, y = torch.randn(batch, 8), torch.randn(batch, 8)
    return Case(CastNet(), F.mse_loss, (x, y), 4)


class _LatentAttention(nn.Module):
    """Slice assignment into activations, as latent-attention (MLA) code builds its queries: a fresh tensor
    filled by `q[..., :k] = ...` / `q[..., k:] = ...`, and an in-place write into the incoming activation."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.nope, self.rope, self.first = nn.Linear(d, d // 2), nn.Linear(d, d // 2), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0                                   # an activation of this module, written in place below
        h[:, 0] = torch.tanh(self.first(x[:, 0]))
        q = h.new_empty(h.shape)
        q[..., : h.shape[-1] // 2] = self.nope(h)
        q[..., h.shape[-1] // 2 :] = torch.sin(self.rope(h)).to(torch.float64)   # a cast on the way in
        return h + q


class LatentNet(nn.Module):
    def __init__(self, blocks: int = 4, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_LatentAttention(d) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def latent_net(batch: int = 2, seq: int = 4) -> Case:
    torch.manual_seed(0)
    x, y = torch.randn(batch, seq, 8), torch.randn(batch, seq, 8)
    return Case(LatentNet(), F.mse_loss, (x, y), 4)


class _RopeBlock(nn.Module):
    """Uses its `freqs` buffer; keeps a saved copy (`freqs_saved`) and a `spare` parameter it never reads."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("freqs", torch.linspace(0.5, 2.0, d))
        self.register_buffer("freqs_saved", torch.linspace(0.5, 2.0, d))
        self.spare = nn.Parameter(torch.randn(d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(h) * self.freqs)


class RopeNet(nn.Module):
    """Blocks with state no stage reads, and one such buffer at the top level."""

    def __init__(self, blocks: int = 4, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_RopeBlock(d) for _ in range(blocks))
        self.register_buffer("step_count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def rope_net(batch: int = 4) -> Case:
    torch.manual_seed(0)
    x, y = torch.randn(batch, 8), torch.randn(batch, 8)
    return Case(RopeNet(), F.mse_loss, (x, y), 4)


class HFSeq2SeqLogits(nn.Module):
    """A HuggingFace encoder-decoder returning just its logits; ids and decoder ids are two model inputs."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, ids: torch.Tensor, dec_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=ids, decoder_input_ids=dec_ids).logits


def hf_t5(layers: int = 2, batch: int = 2, seq: int = 8) -> Case:
    """transformers' T5ForConditionalGeneration from a tiny random config (no downloads): encoder and decoder
    are two T5Stacks whose blocks sit behind ModuleLists, and its attention's `.contiguous()` after SDPA is
    dropped by export."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=layers, num_decoder_layers=layers,
                   num_heads=2, dropout_rate=0.0, decoder_start_token_id=0)
    model = HFSeq2SeqLogits(T5ForConditionalGeneration(cfg))
    ids, dec, tgt = (torch.randint(0, 64, (batch, seq)) for _ in range(3))
    return Case(model, gpt_loss, ((ids, dec), (tgt,)), 4)


class KeywordLM(nn.Module):
    """A keyword-only forward (`model(input_ids=..., attention_mask=...)`, as HF-style wrappers take it), with
    a padding mask beside the ids; blocks in a ModuleList."""

    def __init__(self, layers: int = 4, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_DictBlock(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) * attention_mask[..., None]
        for block in self.blocks:
            h = block(h) * attention_mask[..., None]
        return self.head(h)


def keyword_lm(batch: int = 2, seq: int = 8) -> Case:
    """Inputs as a dict of keyword arguments: data:0 = input_ids, data:1 = attention_mask (its order)."""
    torch.manual_seed(0)
    ids, tgt = torch.randint(0, 32, (batch, seq)), torch.randint(0, 32, (batch, seq))
    mask = (torch.rand(batch, seq) > 0.2).float()
    return Case(KeywordLM(), gpt_loss, ({"input_ids": ids, "attention_mask": mask}, (tgt,)), 4)
