"""A character-level tokenizer built in code, for random-weight models: no vocabulary to download.

It is a real `PreTrainedTokenizerFast` (saveable, loadable, padding and truncation as usual), with
T5's conventions: pad id 0, eos id 1 appended to every sequence, unk id 2.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIALS = ("<pad>", "</s>", "<unk>")
CHARS = string.digits + string.ascii_letters + string.punctuation + " "


def char_vocab() -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    return vocab


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(char_vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
