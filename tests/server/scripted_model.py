"""A loadable model folder whose greedy answer to any chat prompt is a chosen text.

The tokenizer's vocabulary is the text cut into distinct pieces; the model's layers add nothing (their
output projections are zero), its embeddings are one-hot and its head maps each piece to the next one, so
the next token depends on the current token alone: the generation prompt's last token starts the chain,
the last piece leads to end-of-sequence. Everything else (chat template, tokenizer, runner, engine, HTTP)
is real.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<s>", "</s>", "<unk>", "<answer>"]  # <answer> ends every prompt: the chain starts there
EOS, START = 1, 3


def distinct_pieces(text: str, size: int = 4) -> list[str]:
    """`text` cut into pieces of about `size` characters, no two alike (a repeated piece grows)."""
    pieces: list[str] = []
    at = 0
    while at < len(text):
        end = min(at + size, len(text))
        while text[at:end] in pieces and end < len(text):
            end += 1
        if text[at:end] in pieces:  # the tail repeats an earlier piece: join it to the one before
            pieces[-1] += text[at:end]
        else:
            pieces.append(text[at:end])
        at = end
    assert len(set(pieces)) == len(pieces) and "".join(pieces) == text
    return pieces


def save_scripted_model(folder: Path, answer: str) -> Path:
    pieces = distinct_pieces(answer)
    words = SPECIALS + pieces
    vocab, hidden = len(words), max(64, -(-len(words) // 16) * 16)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                         max_position_embeddings=1024, eos_token_id=EOS, bos_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(vocab, hidden)
        nxt = {START: len(SPECIALS)} | {i: i + 1 for i in range(len(SPECIALS), vocab - 1)}
        for token in range(vocab):
            head[nxt.get(token, EOS), token] = 64.0  # a margin no temperature a client sends can overcome
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.Fuse()  # pieces join as written
    tokenizer.add_special_tokens([AddedToken(w, special=True) for w in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}<answer>{% endif %}")
    fast.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": 0}))
    return folder
