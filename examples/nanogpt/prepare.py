"""nanoGPT's data/shakespeare_char/prepare.py in short: a text's characters as uint16 ids,
90% in train.bin, 10% in val.bin (the examples' own source, one folder up, stands in for
Shakespeare)."""
import pathlib

import numpy as np

text = "".join(p.read_text() for p in sorted(pathlib.Path(__file__).parent.parent.glob("*.py")))
chars = sorted(set(text))
ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
cut = int(0.9 * len(ids))
ids[:cut].tofile("train.bin")
ids[cut:].tofile("val.bin")
