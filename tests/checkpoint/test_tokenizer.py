"""load_tokenizer: tokenizer.json (tokenizers) and Kimi's tiktoken.model, special tokens, chat templates,
errors that name the bad file / value, and the CLI's --chat. Fixtures are built here, offline."""

import base64
import collections
import json
import types

import pytest
import regex

from ddtree_jax.checkpoint import load_tokenizer
from ddtree_jax.checkpoint import tokenizer as tokenizer_module
from ddtree_jax.checkpoint.tokenizer import KIMI_PAT_STR, read_tiktoken_ranks

CORPUS = """def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

The quick brown fox jumps over the lazy dog. It's the dog's day; they'll say we're done.
Les élèves étudient à l'école. 中文分词测试，中文文本。 Ünïcödé text and emoji 🙂🙂 here.
for (int i = 0; i < 100; ++i) { total += values[i] * 2; }  // 12345 67890
"""

TEXTS = [
    "Hello world, the quick brown fox!",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "中文分词测试 mixed with English and 数字 1234567",
    "Ünïcödé café naïve — “quotes” and emoji 🙂👍🏽 and tabs\t\tand\r\nnew lines\n\n\n",
    "It's THEIR dog's ball; we'd've   spaced    out   ",
    "",
]

# Kimi K2's layout: special tokens right after the BPE ranks, offsets as in K2's tokenizer_config.json
# ([BOS] = first, [EOS], <|im_end|>, <|im_user|>, <|im_assistant|>, ..., <|im_system|>, <|im_middle|>).
KIMI_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    17: "<|im_middle|>",
}

# A short template in the style of Kimi K2's (tool declaration, the default system prompt, one
# <|im_{role}|>{role}<|im_middle|>...<|im_end|> block per message, the generation prompt).
KIMI_TEMPLATE = (
    "{%- if tools -%}\n"
    "  <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>\n"
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "  {%- if loop.first and messages[0]['role'] != 'system' -%}\n"
    "    <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>\n"
    "  {%- endif -%}\n"
    "  {%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>\n"
    "  {%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>\n"
    "  {%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>\n"
    "  {%- else -%}{{ raise_exception('unknown role: ' ~ message['role']) }}\n"
    "  {%- endif -%}\n"
    "  {{- message['content'] -}}<|im_end|>\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
KIMI_SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_PATTERN = regex.compile(KIMI_PAT_STR, regex.V1)  # V1: the class intersections (&&) of Kimi's regex


def _train_ranks(corpus: str, merges: int) -> dict[bytes, int]:
    """A byte-level BPE vocabulary: the 256 bytes (ranks 0..255), then `merges` most-frequent-pair
    merges within the regex pieces, each new token ranked after its parts."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in piece.encode()] for piece in _PATTERN.findall(corpus)]
    for _ in range(merges):
        counts = collections.Counter(pair for word in words for pair in zip(word, word[1:]))
        if not counts:
            break
        (a, b), _ = counts.most_common(1)[0]
        ranks.setdefault(a + b, len(ranks))
        for word in words:
            i = 0
            while i < len(word) - 1:
                if word[i] == a and word[i + 1] == b:
                    word[i : i + 2] = [a + b]
                i += 1
    return ranks


def _reference_encode(ranks: dict[bytes, int], text: str) -> list[int]:
    """tiktoken's algorithm written out: per regex piece, repeatedly merge the adjacent pair whose
    concatenation has the lowest rank (leftmost on ties)."""
    ids = []
    for piece in _PATTERN.findall(text):
        parts = [bytes([b]) for b in piece.encode()]
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], float("inf")))
            if parts[best] + parts[best + 1] not in ranks:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        ids.extend(ranks[p] for p in parts)
    return ids


@pytest.fixture(scope="module")
def ranks():
    return _train_ranks(CORPUS, 300)


def _write_tiktoken(directory, ranks, config=None, **extra):
    directory.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in sorted(ranks.items(), key=lambda t: t[1])]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(ranks)
    if config is None:
        config = {
            "added_tokens_decoder": {
                str(n + k): {
                    "content": name,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for k, name in KIMI_SPECIALS.items()
            },
            "bos_token": "[BOS]",
            "eos_token": "[EOS]",
            "chat_template": KIMI_TEMPLATE,
            "tokenizer_class": "TikTokenTokenizer",
        }
    config.update(extra)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def kimi(tmp_path_factory, ranks):
    return load_tokenizer(str(_write_tiktoken(tmp_path_factory.mktemp("kimi"), ranks)))


# ---------------------------------------------------------------------------------------------- tiktoken


def test_tiktoken_encodes_like_bpe_and_round_trips(kimi, ranks):
    assert kimi.kind == "tiktoken" and len(ranks) > 400
    assert read_tiktoken_ranks(kimi.source) == ranks
    for text in TEXTS:
        ids = kimi.encode(text)
        assert ids == _reference_encode(ranks, text), text
        assert kimi.decode(ids) == text
        assert all(i < len(ranks) for i in ids)
    code = TEXTS[1]
    assert len(kimi.encode(code)) < len(code.encode()) / 2  # the merges are used
    # Han runs are their own pieces: no merge crosses from Chinese into Latin letters
    assert kimi.encode("中文abc") == kimi.encode("中文") + kimi.encode("abc")


def test_tiktoken_special_tokens_follow_the_ranks(kimi, ranks):
    n = len(ranks)
    assert kimi.vocab_size == n + 256
    assert set(kimi.special_tokens.values()) == set(range(n, n + 256))
    for offset, name in KIMI_SPECIALS.items():
        assert kimi.special_tokens[name] == n + offset == kimi.token_to_id(name)
    # ids of the reserved range that tokenizer_config.json does not name: Kimi's <|reserved_token_{id}|>
    assert kimi.token_to_id(f"<|reserved_token_{n + 5}|>") == n + 5
    assert kimi.token_to_id(f"<|reserved_token_{n + 255}|>") == n + 255
    assert kimi.token_to_id("def") == ranks[b"def"] and kimi.token_to_id("no such token!") is None
    assert (kimi.bos_token, kimi.bos_token_id, kimi.eos_token, kimi.eos_token_id) == ("[BOS]", n, "[EOS]", n + 1)

    text = "[BOS]<|im_user|>user<|im_middle|>héllo 中文<|im_end|>"
    ids = kimi.encode(text)
    assert ids[:2] == [n, n + 3] and ids[-1] == n + 2
    assert ids[2:-1] == kimi.encode("user") + [n + 17] + kimi.encode("héllo 中文")
    assert kimi.decode(ids) == text
    assert kimi.decode(ids, skip_special_tokens=True) == "userhéllo 中文"
    plain = kimi.encode(text, allow_special=False)
    assert all(i < n for i in plain) and kimi.decode(plain) == text
    assert kimi.encode(text, add_special_tokens=True) == ids  # the tiktoken format adds nothing


def test_tiktoken_long_runs_are_cut_like_kimi(kimi, monkeypatch):
    cut = list(tokenizer_module._split_long_runs("aaaaaaa  bb" + " " * 7 + "c", 3))
    assert cut == ["aaa", "aaa", "a  bb   ", "   ", " c"]
    assert "".join(cut) == "aaaaaaa  bb" + " " * 7 + "c"
    assert list(tokenizer_module._split_long_runs("", 3)) == [""]
    monkeypatch.setattr(tokenizer_module, "_TIKTOKEN_MAX_RUN", 4)
    text = "abcdefghij     klm"
    expected = [i for piece in ["abcd", "efgh", "ij    ", " klm"] for i in kimi.backend.encode(piece)]
    assert kimi.encode(text) == expected and kimi.decode(expected) == text


def test_kimi_chat_template(kimi, ranks):
    n = len(ranks)
    assert kimi.has_chat_template and kimi.template_source.endswith("tokenizer_config.json")
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = kimi.apply_chat_template(messages)
    assert text == (
        KIMI_SYSTEM + "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    assert kimi.apply_chat_template(messages, add_generation_prompt=False).endswith("What is 2+2?<|im_end|>")
    ids = kimi.encode(text)
    assert [i - n for i in ids if i >= n] == [10, 17, 2, 3, 17, 2, 4, 17]

    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "ça va?"},
    ]
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"type": "object"}}}]
    text = kimi.apply_chat_template(conversation, tools=tools)
    assert text == (
        '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"météo","parameters":'
        '{"type":"object"}}}]<|im_end|>'
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>hello<|im_end|><|im_user|>user<|im_middle|>ça va?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    with pytest.raises(ValueError, match="tokenizer_config.json: unknown role: robot"):
        kimi.apply_chat_template([{"role": "robot", "content": "beep"}])


# -------------------------------------------------------------------------------------------- tokenizers


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator([CORPUS] * 3, trainer)
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    directory = tmp_path_factory.mktemp("hf")
    hf.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": {"content": "<|im_end|>", "special": True},
                "chat_template": CHATML_TEMPLATE,
            }
        )
    )
    return directory


def test_tokenizers_agrees_with_the_tokenizers_package(hf_dir):
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tok = load_tokenizer(str(hf_dir))
    assert tok.kind == "tokenizers" and tok.vocab_size == hf.get_vocab_size(with_added_tokens=True) > 400
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 2)
    assert tok.special_tokens == {"<s>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, add_special_tokens=True) == hf.encode(text).ids == [0] + ids
        assert tok.decode(ids) == hf.decode(ids) == text
    text = "<|im_start|>user\nhi<|im_end|>"
    assert tok.encode(text)[0] == 1 and tok.encode(text)[-1] == 2
    plain = tok.encode(text, allow_special=False)
    assert not {0, 1, 2} & set(plain) and tok.decode(plain) == text
    assert tok.encode(text)[0] == 1  # the backend's state is restored
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == "user\nhi"

    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.encode(rendered)) == rendered


def test_tokenizer_json_wins_and_empty_directories_have_none(tmp_path, hf_dir, ranks):
    assert load_tokenizer(str(tmp_path)) is None
    both = _write_tiktoken(tmp_path / "both", ranks)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (both / name).write_bytes((hf_dir / name).read_bytes())
    assert load_tokenizer(str(both)).kind == "tokenizers"
    with pytest.raises(ValueError, match="is not a directory"):
        load_tokenizer(str(tmp_path / "missing"))


# ------------------------------------------------------------------------ templates, ids, named templates


def test_template_sources_and_token_ids(tmp_path, ranks):
    n = len(ranks)
    directory = _write_tiktoken(tmp_path / "a", ranks)
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.content }}]{% endfor %}{% if add_generation_prompt %}{{ eos_token }}{% endif %}"
    )
    tok = load_tokenizer(str(directory))  # chat_template.jinja wins over tokenizer_config.json's
    assert tok.template_source.endswith("chat_template.jinja")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[x][EOS]"

    named = [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ messages[0].content }}"},
    ]
    tok = load_tokenizer(str(_write_tiktoken(tmp_path / "b", ranks, chat_template=named)))
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "Dx"
    assert tok.apply_chat_template(messages, template_name="tool_use") == "Tx"
    with pytest.raises(ValueError, match="no chat template named 'rag'"):
        tok.apply_chat_template(messages, template_name="rag")

    # no names in the tokenizer files: bos / eos ids from config.json (top level or text_config; lists: first)
    config = {"added_tokens_decoder": {str(n): {"content": "[BOS]"}, str(n + 1): {"content": "[EOS]"}}}
    directory = _write_tiktoken(tmp_path / "c", ranks, config=config)
    tok = load_tokenizer(str(directory))
    assert (tok.bos_token_id, tok.eos_token_id, tok.has_chat_template) == (None, None, False)
    with pytest.raises(ValueError, match="no chat template for"):
        tok.apply_chat_template(messages)
    text_config = {"bos_token_id": n, "eos_token_id": [n + 1, n + 2]}
    (directory / "config.json").write_text(json.dumps({"text_config": text_config}))
    tok = load_tokenizer(str(directory))
    assert (tok.bos_token_id, tok.eos_token_id) == (n, n + 1)
    special_map = {"eos_token": {"content": f"<|reserved_token_{n + 9}|>"}}
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map))
    assert load_tokenizer(str(directory)).eos_token_id == n + 9

    # a named id past the 256 reserved ones extends the range (Kimi-Linear's file has 258)
    config = {"added_tokens_decoder": {str(n + 257): {"content": "<|extra|>"}}}
    tok = load_tokenizer(str(_write_tiktoken(tmp_path / "d", ranks, config=config)))
    assert tok.vocab_size == n + 258 and tok.token_to_id(f"<|reserved_token_{n + 256}|>") == n + 256
    assert tok.encode("a<|extra|>")[-1] == n + 257


# ------------------------------------------------------------------------------------------------- errors


def _tiktoken_error(tmp_path, ranks, edit=None, config=None, **extra):
    directory = _write_tiktoken(tmp_path / "bad", ranks, config=config, **extra)
    if edit is not None:
        path = directory / "tiktoken.model"
        path.write_text(edit(path.read_text()))
    with pytest.raises(ValueError) as err:
        load_tokenizer(str(directory))
    return str(err.value)


def test_malformed_tiktoken_files_name_the_bad_value(tmp_path, ranks):
    n = len(ranks)
    message = _tiktoken_error(tmp_path, ranks, lambda s: s.replace("IA== 32\n", "IA==32\n"))
    assert "tiktoken.model:33: expected '<base64 token> <rank>', got 'IA==32'" in message
    message = _tiktoken_error(tmp_path, ranks, lambda s: s.replace("IA== 32\n", "I@== 32\n"))
    assert "tiktoken.model:33: bad base64 token 'I@=='" in message
    message = _tiktoken_error(tmp_path, ranks, lambda s: s.replace("IA== 32\n", "IA== x32\n"))
    assert "tiktoken.model:33: bad rank 'x32'" in message
    message = _tiktoken_error(tmp_path, ranks, lambda s: s.replace("IA== 32\n", "IA== 33\n"))
    assert "tiktoken.model:34: rank 33 repeated (first on line 33)" in message
    message = _tiktoken_error(tmp_path, ranks, lambda s: s.replace("IA== 32\n", "IQ== 32\n"))
    assert "token b'!' repeated" in message
    message = _tiktoken_error(tmp_path, ranks, lambda s: s.replace("IA== 32\n", "enp6cQ== 32\n"))  # b"zzzq"
    assert "single byte(s) ['0x20'] are not tokens (1 missing" in message
    message = _tiktoken_error(tmp_path, ranks, lambda s: s.replace(f" {n - 1}\n", f" {n + 5}\n"))
    assert f"ranks are not 0 .. {n - 1} (rank {n - 1} is missing)" in message
    assert "no tokens" in _tiktoken_error(tmp_path, ranks, lambda s: "\n")

    def config(decoder, **extra):
        return {"added_tokens_decoder": decoder, **extra}

    message = _tiktoken_error(tmp_path, ranks, config=config({"12": {"content": "<|x|>"}}))
    assert f"tokenizer_config.json: added token '<|x|>' has id 12, inside the {n} BPE ranks" in message
    message = _tiktoken_error(tmp_path, ranks, config=config({"first": {"content": "<|x|>"}}))
    assert "added_tokens_decoder key 'first' is not a token id" in message
    message = _tiktoken_error(tmp_path, ranks, config=config({str(n): {"special": True}}))
    assert f"added_tokens_decoder['{n}'] has no content string" in message
    twice = config({str(n): {"content": "[X]"}, str(n + 1): {"content": "[X]"}})
    message = _tiktoken_error(tmp_path, ranks, config=twice)
    assert f"special token '[X]' has two ids ({n}, {n + 1})" in message
    message = _tiktoken_error(tmp_path, ranks, config=config({}, eos_token="<|eot|>"))
    assert "tokenizer_config.json: eos_token '<|eot|>' is not a token of" in message
    message = _tiktoken_error(tmp_path, ranks, config=config({}, chat_template={"default": "x"}))
    assert "chat_template must be a string or a list of {name, template}, got {'default': 'x'}" in message
    message = _tiktoken_error(tmp_path, ranks, config=config({}, chat_template=[{"name": "default"}]))
    assert "chat_template entries must be {name, template} strings, got {'name': 'default'}" in message

    directory = _write_tiktoken(tmp_path / "json", ranks)
    (directory / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        load_tokenizer(str(directory))
    (directory / "tokenizer_config.json").write_text("{}")
    (directory / "config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(ValueError, match="config.json: eos_token_id must be an integer, got '2'"):
        load_tokenizer(str(directory))
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ValueError, match="tokenizer.json: not a readable tokenizers file"):
        load_tokenizer(str(directory))


def test_bad_ids_and_templates_raise(kimi, ranks, hf_dir, tmp_path):
    n = len(ranks)
    with pytest.raises(ValueError, match=f"token id {n + 256} is not in the tokenizer"):
        kimi.decode([1, n + 256])
    with pytest.raises(ValueError, match="token id -1 is not in the tokenizer"):
        kimi.decode([-1])
    tok = load_tokenizer(str(hf_dir))
    with pytest.raises(ValueError, match=f"token id {tok.vocab_size} is not in the tokenizer"):
        tok.decode([3, tok.vocab_size])
    with pytest.raises(TypeError):
        kimi.encode(b"bytes")
    broken = load_tokenizer(str(_write_tiktoken(tmp_path / "t", ranks, chat_template="{% for m in messages %}")))
    with pytest.raises(ValueError, match=r"tokenizer_config.json does not parse \(line 1\)"):
        broken.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="has a single chat template, not named ones"):
        kimi.apply_chat_template([], template_name="tool_use")


# ---------------------------------------------------------------------------------------------------- CLI


def test_cli_chat_wraps_the_prompt(tmp_path, ranks, monkeypatch, capsys):
    from ddtree_jax.__main__ import main
    from ddtree_jax.engine import run as run_module

    directory = _write_tiktoken(tmp_path / "kimi", ranks)
    seen = {}

    def fake_load_pair(target, drafter, **kwargs):
        return types.SimpleNamespace(tokenizer=load_tokenizer(target))

    def fake_run(pair, prompts, **kwargs):
        seen["prompt"] = prompts[0]
        answer = pair.tokenizer.encode("4<|im_end|>")
        return {"tau": 1.0, "tokens_per_s": 1.0, "compile_s": 0.0, "run_s": 1.0, "tokens": [answer]}

    monkeypatch.setattr(run_module, "load_pair", fake_load_pair)
    monkeypatch.setattr(run_module, "run", fake_run)
    monkeypatch.setattr(run_module, "check_request", lambda *args, **kwargs: None)  # run is faked too
    common = ["generate", "--target", str(directory), "--method", "ar", "--compilation-cache", ""]
    assert main(common + ["--prompt", "2+2?", "--chat"]) == 0
    tok = load_tokenizer(str(directory))
    assert seen["prompt"] == tok.encode(
        KIMI_SYSTEM + "<|im_user|>user<|im_middle|>2+2?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    assert capsys.readouterr().out.splitlines()[-1] == "4"  # decoded without the special tokens
    assert main(common + ["--prompt", "2+2?"]) == 0
    assert seen["prompt"] == tok.encode("2+2?")

    (directory / "tokenizer_config.json").write_text("{}")
    capsys.readouterr()
    assert main(common + ["--prompt", "2+2?", "--chat"]) == 2  # a usage error: one line, exit 2
    assert "--chat needs a chat template in" in capsys.readouterr().err
    assert main(common + ["--prompt-ids", "1,2", "--chat"]) == 2
    assert "give --prompt" in capsys.readouterr().err
