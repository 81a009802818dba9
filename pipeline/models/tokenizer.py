"""Character-level tokenizers built in code, for random-weight models: no vocabulary to download.

Each is a real `PreTrainedTokenizerFast` (saveable into a diffusers directory, loadable, padding and
truncation as usual) with the special-token conventions of the tokenizer it stands in for:
- T5 (`build_char_tokenizer`): pad id 0, eos id 1 appended to every sequence, unk id 2; no bos.
- CLIP (`build_clip_char_tokenizer`): `<|startoftext|>` (bos) first, `<|endoftext|>` (eos) last,
  padding with eos as CLIP-L's tokenizer does, a model_max_length of 77. CLIP pools the hidden state
  at the first eos, so a text encoder config must name `CLIP_EOS_ID` as its eos_token_id.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIALS = ("<pad>", "</s>", "<unk>")
CLIP_SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|unk|>")
CLIP_BOS_ID, CLIP_EOS_ID = 0, 1
CLIP_MAX_LENGTH = 77
CHARS = string.digits + string.ascii_letters + string.punctuation + " "


def pad_tokens(tokenizer, prompts: list[str], length: int):
    """`prompts` tokenized as diffusers' pipelines do: special tokens added, padded and truncated to
    exactly `length` tokens, as PyTorch tensors (input_ids, attention_mask)."""
    return tokenizer(prompts, padding="max_length", max_length=length, truncation=True,
                     add_special_tokens=True, return_tensors="pt")


def char_vocab(specials: tuple[str, ...] = SPECIALS) -> dict[str, int]:
    """Specials first (ids 0..), then one id per character: 3 + 95 = 98 ids."""
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    return vocab


def _char_model(specials: tuple[str, ...]) -> Tokenizer:
    tok = Tokenizer(models.WordLevel(char_vocab(specials), unk_token=specials[2]))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return tok


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """T5 conventions: `text </s>`, padded with <pad> (0)."""
    tok = _char_model(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def build_clip_char_tokenizer() -> PreTrainedTokenizerFast:
    """CLIP conventions: `<|startoftext|> text <|endoftext|>`, padded with <|endoftext|>, 77 tokens."""
    bos, eos, unk = CLIP_SPECIALS
    tok = _char_model(CLIP_SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, CLIP_BOS_ID), (eos, CLIP_EOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=eos, unk_token=unk,
        model_max_length=CLIP_MAX_LENGTH,
    )
