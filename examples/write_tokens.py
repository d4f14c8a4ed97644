"""Write a token file for ``ddptrain.data.TokenFile``: nanoGPT's ``.bin`` format, the token ids
one after another as little-endian uint16, no header.

The tokens here are bytes (a vocabulary of 256: nothing to download), of the text files given,
or of some Python standard-library source when none is given. For a BPE vocabulary, write the
ids of your tokenizer the same way (nanoGPT's ``data/openwebtext/prepare.py`` does it for GPT-2's).

    python examples/write_tokens.py --out tokens.bin                  # ~100 KB of stdlib source
    python examples/write_tokens.py book.txt notes.md --out tokens.bin
    python examples/write_tokens.py --out big.bin --repeat 1000       # a file larger than memory, for trying
"""

import argparse
from pathlib import Path

import numpy as np


def write_tokens(text: bytes, out: Path, repeat: int = 1) -> int:
    """Write ``text``'s bytes ``repeat`` times as uint16 token ids; the number of tokens written."""
    tokens = np.frombuffer(text, dtype=np.uint8).astype("<u2")
    with open(out, "wb") as handle:
        for _ in range(repeat):  # one copy in memory, however large the file grows
            tokens.tofile(handle)
    return len(tokens) * repeat


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write a byte-level token file (uint16 ids)")
    parser.add_argument("files", nargs="*", type=Path, help="text files (default: stdlib source)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeat", type=int, default=1, help="write the text this many times")
    args = parser.parse_args()
    if args.files:
        text = b"".join(path.read_bytes() for path in args.files)
    else:
        from hf_causal_lm import corpus
        text = corpus()
    count = write_tokens(text, args.out, args.repeat)
    print(f"{args.out}: {count:,} tokens, {args.out.stat().st_size / 1e6:.1f} MB")
