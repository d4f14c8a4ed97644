"""nanoGPT's sample.py in short: a ddptrain run's model.pt into your GPT, then its generate()."""
import pickle
import sys

import torch

from ddptrain.settings.parsing import read_run_config

from nanogpt_task import task

run_dir = sys.argv[1] if len(sys.argv) > 1 else "runs/chars"
model = task(read_run_config(run_dir)).model  # the run's own GPT: its --task-opt settings, from config.json
model.load_state_dict(torch.load(f"{run_dir}/model.pt", weights_only=True))  # plain names: no "module." prefix
model.eval()
with open("meta.pkl", "rb") as f:
    meta = pickle.load(f)
torch.manual_seed(1337)
start = torch.tensor([[meta["stoi"]["\n"]]])
tokens = model.generate(start, max_new_tokens=200, temperature=0.8, top_k=200)[0].tolist()
print(f"sampled {len(tokens) - 1} characters from {run_dir}/model.pt:")
print("".join(meta["itos"][i] for i in tokens))
