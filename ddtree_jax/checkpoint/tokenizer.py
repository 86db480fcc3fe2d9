"""Tokenizers of HF checkpoint directories: `load_tokenizer(directory) -> Tokenizer | None`.

Two vocabulary formats are read, the first one present winning:

- `tokenizer.json`: an HF fast tokenizer (Qwen3 and most HF models), run by the `tokenizers` package.
- `tiktoken.model`: what moonshotai's Kimi K2 / K2.5 / K2.6 ship (remote code `tokenization_kimi.py`,
  class `TikTokenTokenizer`). A text file of lines `<base64 token bytes> <rank>`; the ranks are the
  BPE merge priorities and the token ids, 0 .. n - 1. The special tokens follow the ranks: ids
  n .. n + 255 (Kimi's `num_reserved_special_tokens = 256`), named by `tokenizer_config.json`'s
  `added_tokens_decoder` ({"163584": {"content": "[BOS]", ...}, ...}); an id of that range it does not
  name is `<|reserved_token_{id}|>`, as in Kimi's code. (Named ids past n + 255 extend the range, the
  gaps again reserved names: Kimi-Linear's variant of the file has 258 specials.) Text is split with
  Kimi's pre-tokenisation regex (`KIMI_PAT_STR`) and run through `tiktoken`'s BPE.

Beside either: `tokenizer_config.json` (bos / eos and the other special-token names, `chat_template`),
`special_tokens_map.json` (special-token names, when tokenizer_config.json has none), `config.json`
(`bos_token_id` / `eos_token_id`, top level or in `text_config`, when no name is given) and
`chat_template.jinja` (a chat template file; it wins over tokenizer_config.json's `chat_template`,
as in transformers). Chat templates render with jinja2 the way transformers does (sandboxed, blocks
trimmed, `raise_exception`, a `tojson` with `ensure_ascii=False`, `loopcontrols`, `{% generation %}`).
Malformed files raise `ValueError`s that name the file and the bad value.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

# Kimi's pre-tokenisation regex, the `pat_str` of `TikTokenTokenizer` in moonshotai's
# `tokenization_kimi.py` (huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/tokenization_kimi.py; the
# same string in the Kimi-K2.5 / K2.6 and Kimi-Linear copies): runs of Han characters, words (cased
# letter runs with an optional leading non-letter and English contractions), 1-3 digit groups,
# punctuation runs, newlines and other whitespace. A fact of the file format, kept verbatim.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
KIMI_NUM_RESERVED_SPECIAL_TOKENS = 256
# Kimi's encode feeds tiktoken at most 400k characters at a time, each cut further so that no run of
# whitespace or of non-whitespace exceeds 25k characters (tiktoken's regex can overflow its stack on
# longer runs: openai/tiktoken#195). The same cuts here give the same ids on long texts.
_TIKTOKEN_MAX_CHARS = 400_000
_TIKTOKEN_MAX_RUN = 25_000

# The special-token names transformers passes to a chat template (tokenizer_config.json keys).
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """A checkpoint's tokenizer (either format) and its chat template; build it with `load_tokenizer`.

    `kind` is "tokenizers" (tokenizer.json) or "tiktoken" (tiktoken.model); `source` the vocabulary
    file. `bos_token_id` / `eos_token_id` may be None. `eos_token_ids`: every id that ends a generation, as
    HF `generate` stops: the eos id, then each id of config.json's and generation_config.json's
    `eos_token_id` (an int or a list; Qwen3-Instruct lists <|im_end|> and <|endoftext|>). `chat_template` is one template, a
    {name: template} dict (tokenizer_config.json's list form), or None; `template_source` names the
    file it came from. `special_tokens` maps the special tokens' text to their ids.
    """

    kind: str
    source: str
    backend: Any = dataclasses.field(repr=False)
    vocab_size: int
    special_tokens: Mapping[str, int] = dataclasses.field(repr=False)
    bos_token: str | None = None
    eos_token: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | Mapping[str, str] | None = dataclasses.field(default=None, repr=False)
    template_source: str | None = None
    template_tokens: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str, *, allow_special: bool = True, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`.

        allow_special: the special tokens' text (`<|im_end|>`, `[BOS]`) becomes their ids; with False it
        is encoded as plain text. add_special_tokens: run tokenizer.json's post-processor (e.g. a BOS
        it prepends), as transformers' default `encode` does; the tiktoken format has none (Kimi's
        `encode` adds nothing), so there it changes nothing. Chat-template output is encoded with
        the default False, as transformers does.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, not {type(text).__name__}")
        if self.kind == "tokenizers":
            with self._lock:  # encode_special_tokens is state of the shared backend
                self.backend.encode_special_tokens = not allow_special
                try:
                    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
                finally:
                    self.backend.encode_special_tokens = False
        ids: list[int] = []
        for start in range(0, len(text), _TIKTOKEN_MAX_CHARS):
            for piece in _split_long_runs(text[start : start + _TIKTOKEN_MAX_CHARS], _TIKTOKEN_MAX_RUN):
                if allow_special:
                    ids.extend(self.backend.encode(piece, allowed_special="all"))
                else:
                    ids.extend(self.backend.encode(piece, disallowed_special=()))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of `ids` (bytes that are not whole UTF-8 characters become U+FFFD).

        skip_special_tokens drops the special tokens (tokenizer.json: its added tokens marked
        special; tiktoken: all ids past the ranks). An id the tokenizer does not have raises
        ValueError (checkpoints often pad the model's vocabulary past the tokenizer's).
        """
        ids = [int(i) for i in ids]
        if self.kind == "tokenizers":
            for i in ids:
                if i < 0 or self.backend.id_to_token(i) is None:
                    raise ValueError(f"token id {i} is not in the tokenizer ({self.source})")
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"token id {i} is not in the tokenizer ({self.source}, ids 0 .. {self.vocab_size - 1})"
                )
        if skip_special_tokens:
            first_special = self.backend.n_vocab - len(self.special_tokens)
            ids = [i for i in ids if i < first_special]
        return self.backend.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        """The id of one token given by its text (a special token or a vocabulary entry), else None."""
        if token in self.special_tokens:
            return self.special_tokens[token]
        if self.kind == "tokenizers":
            return self.backend.token_to_id(token)
        try:
            return self.backend.encode_single_token(token.encode("utf-8"))
        except KeyError:
            return None

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        template_name: str | None = None,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **kwargs,
    ) -> str:
        """Renders `messages` ([{"role": ..., "content": ...}, ...]) through the chat template, as
        transformers' `apply_chat_template(..., tokenize=False)` does: the template sees `messages`,
        `tools`, `documents`, `add_generation_prompt`, the special-token names (`bos_token`,
        `eos_token`, ...) and `kwargs`. A template list picks `template_name`, else its "default".
        Raises ValueError when there is no template, or when rendering fails (`raise_exception` in the
        template included).
        Encode the result with `encode(text)` (special tokens allowed, nothing added).
        """
        template = self._template(template_name)
        context = {**self.template_tokens, **kwargs}
        import jinja2

        try:
            return _compile_template(template).render(
                messages=messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(
                f"chat template of {self.template_source} does not parse (line {err.lineno}): {err.message}"
            ) from err
        except jinja2.TemplateError as err:  # raise_exception(...) in the template, undefined calls, ...
            raise ValueError(f"chat template of {self.template_source}: {err}") from err

    def _template(self, name: str | None) -> str:
        if not self.chat_template:
            raise ValueError(
                f"no chat template for {os.path.dirname(self.source) or '.'} "
                "(neither chat_template.jinja nor tokenizer_config.json's chat_template)"
            )
        if isinstance(self.chat_template, str):
            if name is not None:
                raise ValueError(f"{self.template_source} has a single chat template, not named ones ({name!r})")
            return self.chat_template
        name = "default" if name is None else name
        if name not in self.chat_template:
            raise ValueError(
                f"{self.template_source} has no chat template named {name!r} (it has {sorted(self.chat_template)})"
            )
        return self.chat_template[name]


def load_tokenizer(directory: str) -> Tokenizer | None:
    """The tokenizer of an HF checkpoint directory: tokenizer.json if present, else tiktoken.model
    (Kimi), else None. Special-token names, ids and the chat template come from the files beside it
    (module docstring). Malformed files raise ValueError naming the file and the bad value."""
    if not os.path.isdir(directory):
        raise ValueError(f"{directory} is not a directory")
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    if os.path.exists(path := os.path.join(directory, "tokenizer.json")):
        kind, backend = "tokenizers", _load_tokenizers(path)
        special_tokens = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        vocab_size = backend.get_vocab_size(with_added_tokens=True)
    elif os.path.exists(path := os.path.join(directory, "tiktoken.model")):
        kind = "tiktoken"
        backend, special_tokens = _load_tiktoken(path, config, os.path.join(directory, "tokenizer_config.json"))
        vocab_size = backend.n_vocab
    else:
        return None
    tokenizer = Tokenizer(kind, path, backend, vocab_size, special_tokens)
    template, template_source = _read_chat_template(directory, config)
    names, ids = _special_token_names(directory, config, tokenizer)
    return dataclasses.replace(
        tokenizer,
        bos_token=names.get("bos_token"),
        eos_token=names.get("eos_token"),
        bos_token_id=ids["bos_token"],
        eos_token_id=ids["eos_token"],
        eos_token_ids=_eos_token_ids(directory, ids["eos_token"]),
        chat_template=template,
        template_source=template_source,
        template_tokens=names,
    )


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """The mergeable ranks of a tiktoken.model file ({token bytes: rank}), checked: every line is
    `<base64> <rank>`, tokens and ranks are unique, the ranks are 0 .. n - 1 and every single byte
    is a token (else tiktoken could not encode arbitrary text)."""
    ranks: dict[bytes, int] = {}
    seen: dict[int, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{lineno}: expected '<base64 token> <rank>', got {_show(line)}")
            try:
                token = base64.b64decode(parts[0], validate=True)
            except binascii.Error:
                raise ValueError(f"{path}:{lineno}: bad base64 token {_show(parts[0])}") from None
            try:
                rank = int(parts[1])
            except ValueError:
                raise ValueError(f"{path}:{lineno}: bad rank {_show(parts[1])}") from None
            if rank < 0:
                raise ValueError(f"{path}:{lineno}: negative rank {rank}")
            if token in ranks:
                raise ValueError(f"{path}:{lineno}: token {token!r} repeated (first with rank {ranks[token]})")
            if rank in seen:
                raise ValueError(f"{path}:{lineno}: rank {rank} repeated (first on line {seen[rank]})")
            ranks[token] = rank
            seen[rank] = lineno
    if not ranks:
        raise ValueError(f"{path}: no tokens")
    if max(seen) != len(ranks) - 1:
        missing = min(set(range(len(ranks))) - set(seen))
        raise ValueError(f"{path}: ranks are not 0 .. {len(ranks) - 1} (rank {missing} is missing)")
    missing_bytes = [b for b in range(256) if bytes([b]) not in ranks]
    if missing_bytes:
        raise ValueError(
            f"{path}: single byte(s) {[hex(b) for b in missing_bytes[:8]]} are not tokens "
            f"({len(missing_bytes)} missing; every byte must be one)"
        )
    return ranks


def _load_tiktoken(path: str, config: dict, config_path: str):
    import tiktoken

    ranks = read_tiktoken_ranks(path)
    first = len(ranks)
    named: dict[int, str] = {}
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise ValueError(f"{config_path}: added_tokens_decoder must be an object, got {_show(decoder)}")
    for key, entry in decoder.items():
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(f"{config_path}: added_tokens_decoder key {key!r} is not a token id") from None
        content = entry.get("content") if isinstance(entry, dict) else entry
        if not isinstance(content, str) or not content:
            raise ValueError(f"{config_path}: added_tokens_decoder[{key!r}] has no content string: {_show(entry)}")
        if token_id < first:
            raise ValueError(
                f"{config_path}: added token {content!r} has id {token_id}, inside the {first} BPE "
                f"ranks of {path} (special tokens must come after them)"
            )
        named[token_id] = content
    end = max(first + KIMI_NUM_RESERVED_SPECIAL_TOKENS, max(named, default=0) + 1)
    special_tokens: dict[str, int] = {}
    for token_id in range(first, end):
        name = named.get(token_id, f"<|reserved_token_{token_id}|>")
        if name in special_tokens:
            raise ValueError(f"{config_path}: special token {name!r} has two ids ({special_tokens[name]}, {token_id})")
        special_tokens[name] = token_id
    encoding = tiktoken.Encoding(
        name=os.path.basename(os.path.dirname(os.path.abspath(path))) or "tiktoken",
        pat_str=KIMI_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens=special_tokens,
    )
    return encoding, special_tokens


def _load_tokenizers(path: str):
    from tokenizers import Tokenizer as HFTokenizer

    try:
        return HFTokenizer.from_file(path)
    except Exception as err:  # tokenizers raises plain Exceptions for malformed files
        raise ValueError(f"{path}: not a readable tokenizers file ({err})") from err


def _special_token_names(
    directory: str, config: dict, tokenizer: Tokenizer
) -> tuple[dict[str, Any], dict[str, int | None]]:
    """Special-token names (tokenizer_config.json, else special_tokens_map.json) for the template, and
    bos / eos ids: the named token's id, else config.json's bos_token_id / eos_token_id."""
    config_path = os.path.join(directory, "tokenizer_config.json")
    map_path = os.path.join(directory, "special_tokens_map.json")
    special_map = _read_json(map_path)
    names: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key in _SPECIAL_TOKEN_KEYS:
        for source, path in ((config, config_path), (special_map, map_path)):
            value = source.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if value is None:
                continue
            if not isinstance(value, str):
                raise ValueError(f"{path}: {key} must be a string, got {_show(source.get(key))}")
            names[key], origin[key] = value, path
            break
    extra = config.get("additional_special_tokens", special_map.get("additional_special_tokens"))
    if extra is not None:
        names["additional_special_tokens"] = [t.get("content") if isinstance(t, dict) else t for t in extra]
    model_config = _read_json(os.path.join(directory, "config.json"))
    ids: dict[str, int | None] = {}
    for key in ("bos_token", "eos_token"):
        if key in names:
            token_id = tokenizer.token_to_id(names[key])
            if token_id is None:
                raise ValueError(f"{origin[key]}: {key} {names[key]!r} is not a token of {tokenizer.source}")
            ids[key] = token_id
        else:
            ids[key] = _config_token_id(model_config, f"{key}_id", os.path.join(directory, "config.json"))
    return names, ids


def _eos_token_ids(directory: str, eos_token_id: int | None) -> tuple[int, ...]:
    """The eos id, then every id of config.json's (top level or text_config) and generation_config.json's
    `eos_token_id` (an int or a list of ints), deduplicated in that order; ValueError naming the file for a value
    that is not a token id."""
    found = [] if eos_token_id is None else [eos_token_id]
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(directory, name)
        config = _read_json(path)
        value = config.get("eos_token_id")
        if value is None and isinstance(config.get("text_config"), dict):
            value = config["text_config"].get("eos_token_id")
        values = value if isinstance(value, list) else [] if value is None else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{path}: eos_token_id holds {_show(v)}, not a token id (an integer >= 0)")
        found += values
    return tuple(dict.fromkeys(found))


def _config_token_id(config: dict, key: str, path: str) -> int | None:
    value = config.get(key)
    if value is None and isinstance(config.get("text_config"), dict):
        value = config["text_config"].get(key)
    if isinstance(value, list):  # several eos ids: the first is the canonical one
        value = value[0] if value else None
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{path}: {key} must be an integer, got {_show(value)}")
    return value


def _read_chat_template(directory: str, config: dict) -> tuple[str | dict[str, str] | None, str | None]:
    config_path = os.path.join(directory, "tokenizer_config.json")
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read(), jinja_path
    template = config.get("chat_template")
    if template is None:
        return None, None
    if isinstance(template, str):
        return template, config_path
    if isinstance(template, list):
        named = {}
        for entry in template:
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise ValueError(
                    f"{config_path}: chat_template entries must be {{name, template}} strings, got {_show(entry)}"
                )
            named[entry["name"]] = entry["template"]
        return named, config_path
    raise ValueError(
        f"{config_path}: chat_template must be a string or a list of {{name, template}}, got {_show(template)}"
    )


@functools.lru_cache(maxsize=16)
def _compile_template(source: str):
    """A chat template compiled in transformers' jinja environment (its `_compile_jinja_template`)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        import datetime

        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _split_long_runs(text: str, limit: int) -> Iterator[str]:
    """`text` cut so that no piece has a run of more than `limit` whitespace or non-whitespace
    characters (the cut points of Kimi's `_split_whitespaces_or_nonwhitespaces`)."""
    start, run, previous = 0, 0, None
    for i, char in enumerate(text):
        space = char.isspace()
        run = run + 1 if space == previous else 1
        previous = space
        if run > limit:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {_show(value)}")
    return value


def _show(value, limit: int = 80) -> str:
    text = repr(value.decode("utf-8", "replace") if isinstance(value, bytes) else value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
