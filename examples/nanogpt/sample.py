"""nanoGPT's sample.py in short: a ddptrain run's model.pt into your GPT, then its generate()."""
import pickle
import sys

import torch

from model import GPT, GPTConfig
from nanogpt_task import BLOCK

run_dir = sys.argv[1] if len(sys.argv) > 1 else "runs/chars"
with open("meta.pkl", "rb") as f:
    meta = pickle.load(f)
model = GPT(GPTConfig(block_size=BLOCK, vocab_size=meta["vocab_size"], n_layer=2, n_head=2, n_embd=64))
model.load_state_dict(torch.load(f"{run_dir}/model.pt", weights_only=True))  # plain names: no "module." prefix
model.eval()
torch.manual_seed(1337)
start = torch.tensor([[meta["stoi"]["\n"]]])
tokens = model.generate(start, max_new_tokens=200, temperature=0.8, top_k=200)[0].tolist()
print(f"sampled {len(tokens) - 1} characters from {run_dir}/model.pt:")
print("".join(meta["itos"][i] for i in tokens))
