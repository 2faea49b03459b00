"""Tokenisers for local data: a ``tokenizer.json`` through the ``tokenizers`` library (``--tokenizer DIR``), or
byte-level (raw UTF-8 bytes, ids 0-255, EOS 0: NUL never occurs in text) when none is given."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import PluginError


class ByteTokenizer:
    """UTF-8 bytes as ids; EOS 0."""

    vocab_size = 256
    eos_id = 0

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]


class FileTokenizer:
    """A ``tokenizers.Tokenizer`` from ``DIR/tokenizer.json``; EOS from ``DIR/tokenizer_config.json``'s ``eos_token``
    (or ``eos_token``); no special tokens added by its post-processor (the packer puts EOS between documents)."""

    def __init__(self, directory, eos_token: str | None = None):
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise PluginError(f"--tokenizer {directory}: no tokenizer.json there")
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise PluginError("--tokenizer needs the tokenizers library -> pip install 'parallel-recipe[data]'") from e
        self.tok = Tokenizer.from_file(str(path))
        if eos_token is None:
            config = Path(directory) / "tokenizer_config.json"
            eos = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
            eos_token = eos.get("content") if isinstance(eos, dict) else eos
        if eos_token is None:
            raise PluginError(f"--tokenizer {directory}: no eos_token in tokenizer_config.json -> add one")
        self.eos_id = self.tok.token_to_id(eos_token)
        if self.eos_id is None:
            raise PluginError(f"--tokenizer {directory}: its eos_token {eos_token!r} is not in its vocabulary")
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]


def load_tokenizer(directory=None, *, model_vocab: int):
    """The tokenizer of ``directory`` (byte-level when None), refused when its vocabulary exceeds ``model_vocab``."""
    tok = ByteTokenizer() if directory is None else FileTokenizer(directory)
    if tok.vocab_size > model_vocab:
        what = "the byte-level tokenizer (no --tokenizer)" if directory is None else f"--tokenizer {directory}"
        raise PluginError(f"{what} has {tok.vocab_size} tokens, more than the model's vocabulary {model_vocab} -> "
                          f"set model.vocab to at least {tok.vocab_size}, or use a smaller tokenizer")
    return tok
