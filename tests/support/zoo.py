"""A zoo of transformers architectures from tiny random configs (no downloads), for tests/e2e/test_zoo.py.

Every factory seeds its own init and returns a models.Case whose example is one microbatch (one sequence or
image); hidden 32, 2 heads, vocab 64, seq 8, every dropout probability 0. The wrappers return just the logits.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from support.models import Case, HFLogits, HFSeq2SeqLogits
from zbcompile.examples.gpt import loss_fn as token_loss
from zbcompile.passes.trace import trace
from zbcompile.split import split_traced

VOCAB, SEQ, D, HEADS, FF = 64, 8, 32, 2, 64
MICROBATCHES = 4   # per step, in the zoo tests (tests/e2e/)


def batch(case) -> tuple[tuple, tuple]:
    """MICROBATCHES distinct microbatches shaped like the example (seeded), inputs then targets."""
    inputs, targets = case.example
    g = torch.Generator().manual_seed(1)

    def like(x: torch.Tensor) -> torch.Tensor:
        shape = (MICROBATCHES * x.shape[0], *x.shape[1:])
        if x.is_floating_point():
            return torch.randn(shape, generator=g, dtype=x.dtype)
        return torch.randint(int(x.min()), int(x.max()) + 1, shape, generator=g, dtype=x.dtype)

    return tuple(like(x) for x in inputs), tuple(like(x) for x in targets)


class ImageLogits(nn.Module):
    """An image classifier taking pixel_values, returning its class logits."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.hf(pixel_values=pixels).logits


def _lm(model: nn.Module, batch: int = 1) -> Case:
    ids, tgt = torch.randint(0, VOCAB, (batch, SEQ)), torch.randint(0, VOCAB, (batch, SEQ))
    return Case(HFLogits(model), token_loss, ((ids,), (tgt,)), 4)


def llama() -> Case:
    """Decoder-only, rotary positions, RMSNorm, SwiGLU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FF, num_hidden_layers=4,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=16,
                      attention_dropout=0.0)
    return _lm(LlamaForCausalLM(cfg))


def mistral() -> Case:
    """Decoder-only, rotary, grouped-query attention (1 key/value head)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FF, num_hidden_layers=4,
                        num_attention_heads=HEADS, num_key_value_heads=1, head_dim=D // HEADS,
                        max_position_embeddings=16, sliding_window=None, attention_dropout=0.0)
    return _lm(MistralForCausalLM(cfg))


def qwen2() -> Case:
    """Decoder-only, rotary, biased q/k/v projections."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=D, intermediate_size=FF, num_hidden_layers=4,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=16,
                      attention_dropout=0.0)
    return _lm(Qwen2ForCausalLM(cfg))


def bloom() -> Case:
    """Decoder-only, ALiBi position biases; word embeddings tied to the head."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    cfg = BloomConfig(vocab_size=VOCAB, hidden_size=D, n_layer=4, n_head=HEADS, hidden_dropout=0.0,
                      attention_dropout=0.0)
    return _lm(BloomForCausalLM(cfg))


def gpt2() -> Case:
    """Decoder-only, learned positions; wte tied to lm_head."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=D, n_layer=4, n_head=HEADS,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return _lm(GPT2LMHeadModel(cfg))


def gpt_neox() -> Case:
    """Decoder-only, partial rotary, parallel attention and MLP residual."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FF, num_hidden_layers=4,
                        num_attention_heads=HEADS, max_position_embeddings=16, rotary_pct=0.5,
                        attention_dropout=0.0, hidden_dropout=0.0)
    return _lm(GPTNeoXForCausalLM(cfg))


def opt() -> Case:
    """Decoder-only, learned positions with OPT's offset of 2."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=D, ffn_dim=FF, num_hidden_layers=4, num_attention_heads=HEADS,
                    max_position_embeddings=16, word_embed_proj_dim=D, dropout=0.0, attention_dropout=0.0,
                    activation_dropout=0.0, layerdrop=0.0, pad_token_id=1)
    return _lm(OPTForCausalLM(cfg))


def bert_mlm() -> Case:
    """Encoder-only masked LM (bidirectional attention, token type and learned position embeddings)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=4, num_attention_heads=HEADS,
                     intermediate_size=FF, max_position_embeddings=16, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return _lm(BertForMaskedLM(cfg))


def roberta_mlm() -> Case:
    """Encoder-only masked LM with positions counted from the padding index."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    torch.manual_seed(0)
    cfg = RobertaConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=4, num_attention_heads=HEADS,
                        intermediate_size=FF, max_position_embeddings=16 + 2, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=1)
    case = _lm(RobertaForMaskedLM(cfg))
    (ids,), tgt = case.example
    return case._replace(example=((ids.clamp_min(2),), tgt))   # no padding tokens


def _seq2seq(model: nn.Module) -> Case:
    ids, dec, tgt = (torch.randint(2, VOCAB, (1, SEQ)) for _ in range(3))
    return Case(HFSeq2SeqLogits(model), token_loss, ((ids, dec), (tgt,)), 4)


def bart() -> Case:
    """Encoder-decoder, learned positions, cross-attention; shared embeddings tied to the head."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    cfg = BartConfig(vocab_size=VOCAB, d_model=D, encoder_layers=2, decoder_layers=2, encoder_attention_heads=HEADS,
                     decoder_attention_heads=HEADS, encoder_ffn_dim=FF, decoder_ffn_dim=FF,
                     max_position_embeddings=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                     encoder_layerdrop=0.0, decoder_layerdrop=0.0)
    return _seq2seq(BartForConditionalGeneration(cfg))


def t5() -> Case:
    """Encoder-decoder with relative position buckets."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=VOCAB, d_model=D, d_kv=D // HEADS, d_ff=FF, num_layers=2, num_decoder_layers=2,
                   num_heads=HEADS, dropout_rate=0.0, decoder_start_token_id=0)
    return _seq2seq(T5ForConditionalGeneration(cfg))


def vit() -> Case:
    """Vision transformer: 8x8 images in 4x4 patches, CLS token, learned positions; a 5-class head."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=D, num_hidden_layers=4,
                    num_attention_heads=HEADS, intermediate_size=FF, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, num_labels=5)
    model = ImageLogits(ViTForImageClassification(cfg))
    x, y = torch.randn(1, 3, 8, 8), torch.randint(0, 5, (1,))
    return Case(model, F.cross_entropy, ((x,), (y,)), 4)


def mixtral() -> Case:
    """Mixture of experts: 4 experts, top-2 routing, rotary."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FF, num_hidden_layers=4,
                        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=16,
                        num_local_experts=4, num_experts_per_tok=2, sliding_window=None, attention_dropout=0.0,
                        router_jitter_noise=0.0)
    return _lm(MixtralForCausalLM(cfg))


def gemma2() -> Case:
    """Gemma 2: soft-capped attention scores and logits (`c * tanh(z / c)` after the tied head), sliding-window
    layers between global ones, embeddings scaled by sqrt(d), RMSNorm with a +1 offset."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=D, intermediate_size=FF, num_hidden_layers=4,
                       num_attention_heads=HEADS, num_key_value_heads=1, head_dim=D // HEADS,
                       query_pre_attn_scalar=D // HEADS, max_position_embeddings=16, sliding_window=4,
                       final_logit_softcapping=3.0, attn_logit_softcapping=5.0, attention_dropout=0.0)
    return _lm(Gemma2ForCausalLM(cfg))


def qwen2_moe() -> Case:
    """Mixture of experts with a shared expert: 4 experts, top-2 routing."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FF, moe_intermediate_size=FF,
                         shared_expert_intermediate_size=FF, num_hidden_layers=4, num_attention_heads=HEADS,
                         num_key_value_heads=HEADS, max_position_embeddings=16, num_experts=4,
                         num_experts_per_tok=2, decoder_sparse_step=1, attention_dropout=0.0)
    return _lm(Qwen2MoeForCausalLM(cfg))


ZOO = {f.__name__: f for f in (llama, mistral, qwen2, bloom, gpt2, gpt_neox, opt, bert_mlm, roberta_mlm, bart, t5,
                               vit, mixtral, qwen2_moe, gemma2)}


@functools.lru_cache(maxsize=None)
def traced(arch: str):
    """(case, its traced step): one trace per architecture for every schedule a test module splits it for (the
    trace does not depend on the schedule; the cuts, stage layout and vocabulary shards do, see split)."""
    case = ZOO[arch]()
    case.model.train()
    return case, trace(case.model, case.loss_fn, case.example)


def split(arch: str, schedule):
    """compiler.split_for's split of `arch` for `schedule`, from the architecture's one trace: (case, staged)."""
    case, step = traced(arch)
    groups = schedule.stage_groups()
    return case, split_traced(case.model, step, num_stages=schedule.num_model_stages,
                              placement=groups if len(set(groups)) > 1 else None,
                              vocab_shards=schedule.num_ranks if schedule.vocab_shards else None)
