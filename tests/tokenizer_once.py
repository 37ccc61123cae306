"""Every tokenizer a test process loads from the same tokenizer.json content shares one parsed backend.

The real Llama 3.2 tokenizer takes about 0.6 s to parse and the suite's runs load it over a hundred times, the
product once a run. A backend is only read, or set alike for the same content, by what loads it (transformers'
wrapper, our runs); each load still builds its own wrapper from the folder's config. Imported by tests/conftest.py,
and a pytest plugin (`-p tests.tokenizer_once`) for the suites the tests start in processes of their own."""

from __future__ import annotations

import hashlib


def parse_each_tokenizer_file_once() -> None:
    import tokenizers
    import transformers.tokenization_utils_tokenizers as backend_module

    if getattr(backend_module, "TokenizerFast", None) is not tokenizers.Tokenizer:
        return  # another transformers (or already installed): it loads as it does
    parsed: dict[bytes, tokenizers.Tokenizer] = {}

    class ParsedOnce:
        def __new__(cls, *args, **kwargs):
            return tokenizers.Tokenizer(*args, **kwargs)

        from_str = staticmethod(tokenizers.Tokenizer.from_str)

        @staticmethod
        def from_file(path: str) -> tokenizers.Tokenizer:
            with open(path, "rb") as f:
                key = hashlib.sha1(f.read()).digest()
            if key not in parsed:
                parsed[key] = tokenizers.Tokenizer.from_file(path)
            return parsed[key]

    backend_module.TokenizerFast = ParsedOnce


parse_each_tokenizer_file_once()
