"""Deterministic multilingual corpus for the tokenizer oracle and benchmark.

`corpus(n_bytes, seed)` mixes English, Han (Chinese), Japanese, Korean, Cyrillic, Arabic,
emoji with ZWJ sequences, accented Latin with combining marks, code, JSON, whitespace and
\\r\\n runs and digit runs. Snippets are hand-written; bulk comes from seeded recombination,
so the same (n_bytes, seed) always gives the same text.
"""

import json
import random

ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged that we'll need more tokens than we'd like.",
    "They're sure you've seen it; I'm not, and he'd say DON'T or Can'T or WE'LL.",
    "Streaming the experts from NVMe keeps the resident set small.",
    "HELLO World! Mixed CASE words like iPhone, McDonald, XMLHttpRequest and camelCase.",
    "Numbers: 3.14159, 2,718,281, 1e-9, 0x7fff, v1.2.3 and 12345678901234567890.",
    "Punctuation!!! ... --- ??? (parentheses) [brackets] {braces} <angles> \"quotes\" 'single'.",
    "Café, naïve, résumé, coöperate, façade, jalapeño, Ångström, Øresund, Straße.",
]
HAN = [
    "你好世界，今天天气很好。",
    "中文English混合在一起的句子。",
    "机器学习和深度学习是人工智能的重要分支。",
    "我们在一台机器上运行两万亿参数的模型。",
    "北京、上海、广州和深圳都是大城市。",
    "数据流水线由多个进程组成，每个进程负责一个阶段。",
]
JAPANESE = [
    "こんにちは、世界！今日はいい天気ですね。",
    "東京タワーはとても高いです。カタカナとひらがなと漢字。",
    "ラーメンを食べに行きましょう。ｶﾀｶﾅ半角もあります。",
    "吾輩は猫である。名前はまだ無い。",
]
KOREAN = [
    "안녕하세요, 세계! 오늘 날씨가 좋네요.",
    "한국어 문장은 띄어쓰기를 사용합니다.",
    "서울은 대한민국의 수도입니다.",
]
CYRILLIC = [
    "Привет, мир! Как дела?",
    "Москва — столица России. ЁЛКА и ёлка.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Україна, Київ, їжак, ґанок.",
]
ARABIC = [
    "مرحبا بالعالم! كيف حالك اليوم؟",
    "اللغة العربية تكتب من اليمين إلى اليسار.",
    "السَّلَامُ عَلَيْكُمْ وَرَحْمَةُ اللهِ",
    "الأرقام ١٢٣٤٥٦٧٨٩٠ والأرقام 1234567890.",
]
OTHER = [
    "Γειά σου Κόσμε! ΑΒΓ αβγ.",
    "नमस्ते दुनिया, यह हिंदी है।",
    "สวัสดีชาวโลก ภาษาไทย",
    "שלום עולם",
    "Tiếng Việt có dấu: Xin chào thế giới.",
    "e\u0301 a\u0308 o\u0302 n\u0303 combining marks, and Ǆ ǅ ǆ titlecase, ʰʲ modifiers.",
]
EMOJI = [
    "👋🌍 Hello! 👨\u200d👩\u200d👧\u200d👦 family, 🏳️\u200d🌈 flag, 👍🏽 thumbs, 🇯🇵🇫🇷 flags.",
    "😀😃😄😁😆😅🤣😂🙂 ❤️ ✨ 🔥 🚀 👩\u200d💻 🧑🏿\u200d🚀",
]
CODE = [
    "def encode(self, text: str) -> list[int]:\n    return [self.ranks[b] for b in text.encode('utf-8')]\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * 2).collect();\n    println!(\"{:?}\", v);\n}\n",
    "for (int i = 0; i < n; i++) {\r\n\tsum += a[i] * b[i];\r\n}\r\n",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;\n",
    "    if x != None and y == 0:\n        raise ValueError(f\"bad {x!r}\")\n\n\n",
    "<div class=\"container\"><p>Hello &amp; goodbye</p></div>\n",
]
WHITESPACE = [
    "   leading spaces", "trailing spaces   ", "tabs\t\there\t", "\n\n\nnewlines\n\n",
    "\r\n\r\nCRLF runs\r\n", "  \n  \n mixed \t \r\n ", "\u00a0nbsp\u3000ideographic space\u2003em",
]


def _json_snippet(rng):
    obj = {
        "id": rng.randint(0, 10**9),
        "name": rng.choice(["alice", "Bob", "李雷", "Ольга", "محمد"]),
        "tags": [rng.choice(["a", "b", "ü", "日本"]) for _ in range(rng.randint(0, 4))],
        "score": round(rng.random() * 100, 3),
        "ok": rng.random() < 0.5,
        "nested": {"k": None, "v": [1, 2, 3]},
    }
    return json.dumps(obj, ensure_ascii=rng.random() < 0.3, indent=rng.choice([None, 2]))


def _digits(rng):
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 40)))


def _syllable_word(rng, script):
    if script == "latin":
        return "".join(rng.choice(["ka", "to", "ri", "ne", "sa", "mu", "le", "qu", "th", "ing", "ed", "er"]) for _ in range(rng.randint(1, 4)))
    if script == "cyr":
        return "".join(rng.choice(["ка", "то", "ри", "не", "са", "му", "ль", "щи", "ия", "ов"]) for _ in range(rng.randint(1, 4)))
    if script == "han":
        return "".join(rng.choice("的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年") for _ in range(rng.randint(1, 6)))
    if script == "kana":
        return "".join(rng.choice("あいうえおかきくけこさしすせそタチツテトナニヌネノ") for _ in range(rng.randint(1, 6)))
    if script == "hangul":
        return "".join(rng.choice("가나다라마바사아자차카타파하는를에서") for _ in range(rng.randint(1, 4)))
    return "".join(rng.choice("ابتثجحخدذرزسشصضطظعغفقكلمنهوي") for _ in range(rng.randint(2, 6)))


POOLS = [ENGLISH, HAN, JAPANESE, KOREAN, CYRILLIC, ARABIC, OTHER, EMOJI, CODE, WHITESPACE]


def corpus(n_bytes, seed=0):
    """Return a str whose UTF-8 encoding is at least n_bytes long."""
    rng = random.Random(seed)
    parts = []
    size = 0
    while size < n_bytes:
        r = rng.random()
        if r < 0.45:
            s = rng.choice(rng.choice(POOLS))
        elif r < 0.55:
            s = _json_snippet(rng)
        elif r < 0.6:
            s = _digits(rng)
        else:
            script = rng.choice(["latin", "latin", "cyr", "han", "kana", "hangul", "arabic"])
            words = [_syllable_word(rng, script) for _ in range(rng.randint(3, 12))]
            sep = "" if script in ("han", "kana") else " "
            s = sep.join(words) + rng.choice([".", "。", "!", "?", ",", ""])
        s += rng.choice([" ", " ", "\n", "\n\n", "\r\n", "  ", "\t"])
        parts.append(s)
        size += len(s.encode("utf-8"))
    return "".join(parts)
