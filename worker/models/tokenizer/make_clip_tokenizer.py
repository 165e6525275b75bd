"""Builds CLIP's BPE tokenizer files from the merges list shipped in the `open_clip_torch` wheel.

Source: `open_clip/bpe_simple_vocab_16e6.txt.gz` inside the PyPI package `open_clip_torch` (MIT, see
LICENSE-open_clip in this folder); the same file is OpenAI CLIP's `clip/bpe_simple_vocab_16e6.txt.gz`
(MIT, LICENSE-CLIP). The vocabulary is rebuilt exactly as CLIP's `SimpleTokenizer.__init__` does
(256 byte symbols, the same with `</w>`, the first 48894 merges, then `<|startoftext|>`,
`<|endoftext|>`: 49408 entries), and `tokenizer.json` is what `transformers.CLIPTokenizer` builds from
those vocab/merges (normalizer NFC + whitespace collapse + lowercase, CLIP split regex, byte-level BPE
with `</w>` end-of-word suffix).

Usage: python make_clip_tokenizer.py [OUT_DIR]   (default: clip/ beside this script)
With `n_merges`, a truncated vocabulary is built (used for the tiny test fixtures).
"""

import gzip
import json
import os
import sys


def bytes_to_unicode():
    # CLIP / GPT-2 byte-to-printable-unicode table.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def bpe_source_path():
    # Located without importing open_clip (its import pulls in torchvision).
    import importlib.util

    spec = importlib.util.find_spec("open_clip")
    return os.path.join(list(spec.submodule_search_locations)[0], "bpe_simple_vocab_16e6.txt.gz")


def vocab_and_merges(n_merges=None):
    lines = gzip.open(bpe_source_path()).read().decode("utf-8").split("\n")
    merges = lines[1 : 49152 - 256 - 2 + 1]
    if n_merges is not None:
        merges = merges[:n_merges]
    merges = [tuple(m.split()) for m in merges]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab += ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(vocab)}, merges


def write_files(out_dir, n_merges=None, pad_token="<|endoftext|>"):
    """Writes vocab.json, merges.txt and returns a transformers CLIPTokenizer over them."""
    from transformers import CLIPTokenizer

    os.makedirs(out_dir, exist_ok=True)
    vocab, merges = vocab_and_merges(n_merges)
    with open(os.path.join(out_dir, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for a, b in merges:
            f.write(f"{a} {b}\n")
    tok = CLIPTokenizer(vocab=vocab, merges=list(merges), pad_token=pad_token, model_max_length=77)
    return tok


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "clip")
    tok = write_files(out)
    tok.backend_tokenizer.save(os.path.join(out, "tokenizer.json"))
    # vocab.json and merges.txt are folded into tokenizer.json; keep only that file in the crate,
    # gzipped (no timestamp, so the bytes are reproducible).
    os.remove(os.path.join(out, "vocab.json"))
    os.remove(os.path.join(out, "merges.txt"))
    import gzip

    with open(os.path.join(out, "tokenizer.json"), "rb") as f:
        data = f.read()
    with open(os.path.join(out, "tokenizer.json.gz"), "wb") as f:
        f.write(gzip.compress(data, compresslevel=9, mtime=0))
    os.remove(os.path.join(out, "tokenizer.json"))
    print("wrote", os.path.join(out, "tokenizer.json.gz"), "vocab size", tok.vocab_size)


if __name__ == "__main__":
    main()
