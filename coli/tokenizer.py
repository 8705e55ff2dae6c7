"""The model's tokenizer (`tokenizer.json` through the `tokenizers` library), with incremental
decoding for streaming: text is released only once it forms complete UTF-8 characters."""

from __future__ import annotations

from pathlib import Path

from coli.errors import ColiError


class Tokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _HFTokenizer
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises plain Exception for bad files
            raise ColiError(f"{path}: cannot load tokenizer: {e}") from None
        self.path = path

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)


class StreamDecoder:
    """Feeds token ids one at a time and returns the newly completed text each time."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = False):
        self.tok, self.skip = tok, skip_special_tokens
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids, self.skip)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more tokens
            return ""
        new, self.emitted = text[self.emitted:], len(text)
        return new

    def flush(self) -> str:
        text = self.tok.decode(self.ids, self.skip)
        new, self.emitted = text[self.emitted:], len(text)
        return new


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    path = Path(model_dir) / "tokenizer.json"
    return Tokenizer(path) if path.is_file() else None
