"""The tokenizer of a folder this server converted from a GGUF, read with the `tokenizers` library alone.

transformers' tokenizer class costs a server about 20 MiB resident for the whole of its life (transformers'
utilities import huggingface_hub, its HTTP client, yaml, PIL and sentencepiece), while for these folders it
only forwards to the `tokenizers.Tokenizer` their tokenizer.json describes (the conversion wrote it with
`save_pretrained`). `ServedTokenizer` is that Tokenizer with the part of transformers' tokenizer API the
server uses: encode, decode, the special tokens, the vocabulary and `apply_chat_template`, rendered as
transformers renders it (a sandboxed jinja2 environment with the same options, filters and globals, the same
variables, messages' None values dropped and reasoning fields aliased). Any folder it cannot describe
exactly (tokenizer_config.json options beyond the special tokens, a template with several named variants)
keeps transformers' class (`loader.load_tokenizer`); tests/model/test_served_tokenizer.py checks the token
ids, rendered chats and fingerprint equal AutoTokenizer's on the bundled models. xgrammar needs transformers'
tokenizer object: `transformers_tokenizer()` loads it at the first structured-output request."""
from __future__ import annotations

import functools
import json
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json keys that change nothing here beyond the special tokens read above; another key (an
# option transformers applies at load: add_bos_token, clean-up, extra special tokens...) keeps transformers
_KNOWN_CONFIG_KEYS = {"backend", "tokenizer_class", "is_local", "local_files_only", "model_max_length",
                      "added_tokens_decoder", "clean_up_tokenization_spaces", "chat_template", *SPECIAL_TOKEN_KEYS}
# the names a message's reasoning is passed under, the first the one templates read (as transformers does)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def readable(path: Path) -> bool:
    """Whether `ServedTokenizer.from_folder` reads this folder as transformers would: one this server
    converted from a GGUF (conversion.json), with a tokenizer.json and nothing in tokenizer_config.json
    that transformers would apply on top of it."""
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    template = config.get("chat_template") if isinstance(config, dict) else None
    return (isinstance(config, dict) and (path / "conversion.json").is_file() and (path / "tokenizer.json").is_file()
            and set(config) <= _KNOWN_CONFIG_KEYS and not config.get("clean_up_tokenization_spaces")
            and (template is None or isinstance(template, str))
            and all(isinstance(config.get(k), (str, type(None))) for k in SPECIAL_TOKEN_KEYS))


class ServedTokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, special_tokens: dict[str, str], chat_template: str | None,
                 path: Path) -> None:
        self.backend_tokenizer = backend
        self.special_tokens_map = special_tokens
        self.chat_template = chat_template
        self.name_or_path = str(path)
        self._transformers = None
        self._lock = threading.Lock()
        for key in SPECIAL_TOKEN_KEYS:
            token = special_tokens.get(key)
            setattr(self, key, token)
            setattr(self, key + "_id", None if token is None else backend.token_to_id(token))

    @classmethod
    def from_folder(cls, path: Path) -> "ServedTokenizer":
        path = Path(path)
        config = json.loads((path / "tokenizer_config.json").read_text())
        template_file = path / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        special = {k: config[k] for k in SPECIAL_TOKEN_KEYS if config.get(k) is not None}
        return cls(tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")), special, template, path)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None
               ) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        # as transformers: off unless asked (readable() admits only folders that leave it off), and skipped for
        # BPE models, where removing spaces before punctuation would change the text
        if clean_up_tokenization_spaces and type(self.backend_tokenizer.model).__name__ != "BPE":
            text = _clean_up_tokenization(text)
        return text

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | list[str]):
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def __call__(self, text: str, add_special_tokens: bool = True) -> "Encoding":
        """transformers' tokenizer(text) for one text: its ids (`.input_ids` or `["input_ids"]`)."""
        ids = self.encode(text, add_special_tokens)
        return Encoding(input_ids=ids, attention_mask=[1] * len(ids))

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, return_dict: bool = False,
                            **kwargs: Any):
        """transformers' apply_chat_template for one conversation of plain dicts (tools as JSON schemas);
        other keyword arguments are the template's variables, as there."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        messages = [_aliased({k: v for k, v in m.items() if v is not None}) for m in conversation]
        text = _compiled(template).render(messages=messages, tools=tools, documents=documents,
                                          add_generation_prompt=add_generation_prompt,
                                          **{**self.special_tokens_map, **kwargs})
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return Encoding(input_ids=ids, attention_mask=[1] * len(ids)) if return_dict else ids

    def transformers_tokenizer(self):
        """transformers' tokenizer of the same folder (for xgrammar, which reads one), loaded on first use."""
        with self._lock:
            if self._transformers is None:
                from .transformers_tokenizer import load_transformers_tokenizer

                self._transformers = load_transformers_tokenizer(Path(self.name_or_path))
            return self._transformers


def _aliased(message: dict) -> dict:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """The template in an environment built as transformers builds it (utils/chat_template_utils.py)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (marks the assistant's tokens for training) renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """namespace() without underscore-prefixed attributes (no way to CPython internals)."""

        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=Dict(), namespace=Namespace)
    return env.from_string(template)


class Encoding(dict):
    """What transformers' BatchEncoding is for one text: a dict whose keys read as attributes too."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (WordPiece-era spacing before punctuation and contractions)."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                           (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text
