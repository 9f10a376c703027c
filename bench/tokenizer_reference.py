"""Reference token ids from llama.cpp, for tests of the tokenizer a GGUF's metadata rebuilds.

Starts ``llama-server`` (found as bench.llama_server finds it: ``TANDEM_LLAMA_SERVER``, then ``PATH``) on
a GGUF, asks its ``/tokenize`` for the ids of each text of a fixed, varied corpus (whitespace runs, many
scripts, emoji sequences, code, control-token text, characters only byte tokens can write) exactly as
``TextTokenizer.encode`` means them (no BOS, control-token text parsed), asks ``/detokenize`` for the text
llama.cpp makes of those ids again, and writes it all as JSON::

    python -m bench.tokenizer_reference --gguf gemma-3-270m-q4_k_m.gguf --out tests/data/gemma3_token_ids.json

    {"gguf_sha256": "...", "cases": [{"text": "...", "ids": [...], "decoded": "..."}]}

``random_strings`` makes the extra texts the live test (tests/test_tokenizer_spm.py) compares against a
running llama-server: seeded mixes of the corpus' own characters and pieces.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

import httpx

from bench.llama_server import LlamaServer, find

_PARAGRAPH = (
    "The history of tokenization is, in a sense, the history of compromise. Early systems split text on "
    "whitespace and punctuation, which worked tolerably for English but failed for languages written without "
    "spaces, such as Chinese, Japanese and Thai. Subword methods - byte-pair encoding, WordPiece, the unigram "
    "language model - arrived in the 2010s and let a fixed vocabulary of 32,000 to 262,144 pieces cover any "
    "text at all: frequent words stay whole, rare ones are spelled out from smaller pieces, and whatever is "
    "left falls back to raw bytes. It's a neat trick (and a surprisingly robust one); still, \"neat\" isn't "
    "\"perfect\": numbers like 3.14159 or 1,000,000, URLs like https://example.com/a?b=c&d=e#f, and code "
    "indented with tabs or with 4 spaces all come out differently, which is why a server must reproduce its "
    "model's tokenizer exactly, down to the last id. "
)

CORPUS: list[str] = [
    # whitespace
    "Hello, world!",
    "hello world",
    " leading space",
    "trailing space ",
    "  two leading and two trailing  ",
    "multiple     spaces   between    words",
    " ",
    "  ",
    "     ",
    " " * 40,
    "a" + " " * 33 + "b",
    "tabs\tbetween\twords",
    "\t\tindented with tabs",
    "mixed \t \t whitespace",
    "line one\nline two",
    "paragraph one\n\nparagraph two\n\n\nthree",
    "\n",
    "\n\n\n\n\n",
    "\n" * 35,
    "windows\r\nline\r\nendings\r\n",
    "trailing newline\n",
    " \n \n ",
    "nbsp\u00a0here and\u2009thin\u200bzero-width",
    # scripts
    "你好，世界。今天天气很好。",
    "中文文本，包含标点符号：“引号”和（括号）。",
    "日本語のテキストです。カタカナとひらがな、漢字。",
    "こんにちは、元気ですか？ｗｗｗ　全角スペース",
    "한국어 텍스트입니다. 안녕하세요!",
    "Ελληνικά: Γειά σου Κόσμε",
    "Русский текст: Привет, мир! Ёжик в тумане.",
    "العربية: مرحبا بالعالم، كيف حالك؟",
    "עברית: שלום עולם",
    "हिन्दी: नमस्ते दुनिया, आप कैसे हैं?",
    "ไทย: สวัสดีชาวโลก",
    "Tiếng Việt: Xin chào thế giới",
    "café naïve résumé façade Ångström Übermensch señor",
    "combining: e\u0301 a\u0308 n\u0303 o\u0302\u0323 Z\u0351\u0308\u033d\u0353",
    "ligatures and symbols: ﬁ ﬂ ½ ² ™ © ° µ ∑ ∫ √ ∞ ≠ ≤ → ⇒ ∀x∃y",
    # emoji
    "emoji: 🙂🚀🔥👍",
    "family ZWJ: 👩\u200d👩\u200d👧\u200d👦 and 👨\u200d💻 and 🏳\ufe0f\u200d🌈",
    "flags: 🇫🇷🇯🇵🇺🇸🇧🇷 🏴\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f",
    "skin tones: 👋🏽 👍🏿 🧑🏻\u200d🤝\u200d🧑🏾",
    "emoji with text🙂no spaces🚀between",
    # code
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n",
    "class Foo:\n    def __init__(self, n: int) -> None:\n        self.n = n\n\n    def __repr__(self):\n"
    "        return f\"Foo({self.n!r})\"\n",
    "if (x != 0 && y >= 1) { return x << 2; } else { return -1; }",
    '{"name": "tandem", "version": "0.1.0", "tags": ["llm", "server"], "ok": true, "n": null}',
    '{\n  "nested": {\n    "list": [1, 2.5, -3e10],\n    "empty": {}\n  }\n}',
    "<html>\n  <body>\n    <div class=\"main\"><b>bold</b> <i>it</i></div>\n  </body>\n</html>",
    "<table><tr><td>1</td><td>2</td></tr></table><footer>end</footer>",
    "SELECT id, name FROM users WHERE age > 21 ORDER BY name;",
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "$ ls -la /usr/local/bin | grep -E '^d' > out.txt 2>&1",
    "x = a_b-c.d/e\\f|g^h~i`j@k#l$m%n&o*p+q=r",
    # numbers and URLs
    "digits 1234567890 and 3.14159 and 2026-11-29 and 1,000,000.00",
    "0 00 000 0000 00000 123456789012345678901234567890",
    "-42 +7 1e-9 0x1F 0b1010 3/4 50% $19.99 €5 ¥100",
    "https://example.com/path/to/page?query=1&x=%20y#frag",
    "mailto:someone@example.org ftp://files.example.net/pub/file.tar.gz",
    # control and user-defined token text
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>",
    "text <eos> more <pad> <unk> <mask> text",
    "<unused0><unused42><unused6000>",
    "<start_of_image> [multimodal] <end_of_image>",
    "<start_of_turn><end_of_turn>",
    "<start_of_turnX> <end_of_turn",
    "</s> <s>strike</s> <b></b> <sub>2</sub>",
    "literal byte token text <0x41><0xFF>",
    # characters only byte tokens write
    "rare: 𠀀𪛖 \x07bell \U0001fae8 \u0378",
    "\U00013000\U0010fffd",
    "repeats: ======== -------- ........ ******** !!!!!!! ????? ~~~~~",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "hahahahahahaha lalalala nanananana",
    "",
    _PARAGRAPH,
    _PARAGRAPH * 3,
]


def _alphabet(corpus: list[str]) -> list[str]:
    return sorted({c for text in corpus for c in text})


def random_strings(n: int, seed: int = 0, corpus: list[str] = CORPUS) -> list[str]:
    """`n` seeded texts, each a random mix of the corpus' characters, its words and its whitespace runs."""
    rng = random.Random(seed)
    chars = _alphabet(corpus)
    words = sorted({w for text in corpus for w in text.split(" ") if w})
    spaces = [" ", "  ", "   ", "\t", "\n", "\n\n", " \n", "    "]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.4:
                parts.append("".join(rng.choice(chars) for _ in range(rng.randint(1, 6))))
            elif r < 0.8:
                parts.append(rng.choice(words))
            else:
                parts.append(rng.choice(spaces))
        out.append("".join(parts))
    return out


def tokenize(http: httpx.Client, text: str) -> list[int]:
    """llama.cpp's ids of `text`: no BOS (add_special false), control-token text parsed."""
    r = http.post("/tokenize", json={"content": text, "add_special": False, "parse_special": True})
    r.raise_for_status()
    return r.json()["tokens"]


def detokenize(http: httpx.Client, ids: list[int]) -> str:
    """llama.cpp's text of `ids`, control tokens written out."""
    r = http.post("/detokenize", json={"tokens": ids})
    r.raise_for_status()
    return r.json()["content"]


def start_server(binary: str, gguf: Path) -> LlamaServer:
    """A small llama-server on `gguf` (one thread, one slot, 512-token context), ready for requests."""
    server = LlamaServer(binary, gguf, threads=1, slots=1, ctx=512)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _dumps(doc: dict) -> str:
    """JSON with one case a line (readable diffs when the reference changes)."""
    cases = ",\n  ".join(json.dumps(c, ensure_ascii=False) for c in doc["cases"])
    return f'{{"gguf_sha256": {json.dumps(doc["gguf_sha256"])},\n "cases": [\n  {cases}\n ]}}\n'


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, required=True, help="the GGUF whose tokenizer to ask llama.cpp about")
    ap.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = ap.parse_args(argv)
    binary = find()
    if binary is None:
        print("llama-server not found: set TANDEM_LLAMA_SERVER to its path (DESIGN §8 says how to build it)",
              file=sys.stderr)
        return 2
    server = start_server(binary, args.gguf)
    try:
        cases = []
        for text in CORPUS:
            ids = tokenize(server.http, text)
            cases.append({"text": text, "ids": ids, "decoded": detokenize(server.http, ids)})
    finally:
        server.stop()  # by its pid (bench.llama_server.LlamaServer.stop)
    doc = {"gguf_sha256": sha256_of(args.gguf), "cases": cases}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(_dumps(doc), encoding="utf-8")
    print(f"{len(cases)} cases, {sum(len(c['ids']) for c in cases)} tokens -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
