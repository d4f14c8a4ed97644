"""nanoGPT's data/shakespeare_char/prepare.py in short: a text's characters as uint16 ids,
90% in train.bin, 10% in val.bin, and meta.pkl to decode them (the examples' own source, one
folder up, stands in for Shakespeare)."""
import pathlib
import pickle

import numpy as np

text = "".join(p.read_text() for p in sorted(pathlib.Path(__file__).parent.parent.glob("*.py")))
chars = sorted(set(text))
ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
cut = int(0.9 * len(ids))
ids[:cut].tofile("train.bin")
ids[cut:].tofile("val.bin")
with open("meta.pkl", "wb") as f:  # what nanoGPT's sample.py reads
    pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)),
                 "stoi": {c: i for i, c in enumerate(chars)}}, f)
