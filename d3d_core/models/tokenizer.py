"""Tokenizers behind one small interface: chat-formatted prompts in, readable tokens out."""

from __future__ import annotations

import unicodedata

from ..limits import MAX_PROMPT_CHARS


def clean_prompt(text) -> str:
    """Normalise user text: reject non-strings and empties, drop control characters and
    lone surrogates (they cannot be encoded), keep emoji / RTL text intact."""
    if not isinstance(text, str):
        raise ValueError("prompt must be text")
    if len(text) > MAX_PROMPT_CHARS:
        raise ValueError(f"prompt is too long: {len(text):,} characters (limit {MAX_PROMPT_CHARS:,})")
    out = []
    for ch in text:
        cat = unicodedata.category(ch)
        if cat == "Cs":  # lone surrogate: not encodable as UTF-8
            continue
        if cat == "Cc" and ch not in "\n\t":
            continue
        out.append(ch)
    text = "".join(out)
    if not text.strip():
        raise ValueError("prompt is empty: type a question or pick an example")
    return text


class HFChatTokenizer:
    """A Hugging Face tokenizer with its chat template."""

    def __init__(self, tok, system_prompt=None, template_kwargs=None):
        self.tok = tok
        self.template_kwargs = dict(template_kwargs or {})  # e.g. Qwen3: enable_thinking=False
        self.vocab_size = len(tok)
        eos = set()
        for t in (tok.eos_token, "<|im_end|>", "<|endoftext|>"):
            if t is not None:
                i = tok.convert_tokens_to_ids(t)
                if isinstance(i, int) and i != tok.unk_token_id:
                    eos.add(i)
        self.eos_ids = frozenset(eos)
        self.system_prompt = system_prompt

    def encode_prompt(self, text: str, chat: bool = True) -> list:
        text = clean_prompt(text)
        if chat and self.tok.chat_template:
            msgs = [{"role": "user", "content": text}]
            if self.system_prompt:
                msgs.insert(0, {"role": "system", "content": self.system_prompt})
            s = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **self.template_kwargs)
            return self.tok.encode(s, add_special_tokens=False)
        return self.tok.encode(text, add_special_tokens=False)

    def encode_messages(self, messages: list) -> list:
        s = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **self.template_kwargs)
        return self.tok.encode(s, add_special_tokens=False)

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_strings(self, ids) -> list:
        """Readable text of each token (byte-level pieces decoded one by one)."""
        return [self.tok.decode([i], skip_special_tokens=False) for i in ids]


class CharTokenizer:
    """Trivial character tokenizer for the toy bundle: exact and instant."""

    SPECIALS = ["<pad>", "<eos>", "<user>", "<asst>"]

    def __init__(self, alphabet: str = "abcdefghijklmnopqrstuvwxyz0123456789 .,?!+-=\n"):
        self.itos = self.SPECIALS + list(alphabet)
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.vocab_size = len(self.itos)
        self.eos_ids = frozenset({1})

    def encode_prompt(self, text: str, chat: bool = True) -> list:
        text = clean_prompt(text)
        ids = [self.stoi[c] for c in text.lower() if c in self.stoi]
        return ([2] + ids + [3]) if chat else ids

    def encode_messages(self, messages: list) -> list:
        return self.encode_prompt(" ".join(m["content"] for m in messages))

    def decode(self, ids, skip_special: bool = False) -> str:
        first = len(self.SPECIALS) if skip_special else 0
        return "".join(self.itos[i] if 0 <= i < len(self.itos) else "?" for i in ids if not 0 <= i < first)

    def token_strings(self, ids) -> list:
        return [self.itos[i] if 0 <= i < len(self.itos) else "?" for i in ids]
