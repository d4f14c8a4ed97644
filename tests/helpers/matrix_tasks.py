"""The combination matrix's task (tests/helpers/matrix.py): one factory whose data shape the
environment names, so every case runs the same model code. Named ``matrix_tasks:matrix``.

- MATRIX_DATA: ``map_even`` (256 samples), ``map_uneven`` (250: no step or rank divides it),
  ``stream_even`` (256 samples read in order, equal shares), ``stream_uneven`` (240 samples in
  shares in proportion to (i+1)², data_tasks.SquareShares), ``token_file`` (TOKEN_FILE's
  windows of 16 tokens for a tiny language model).
- Map-style sets go through a DataLoader (``--workers`` counts), never the in-memory fast path.
- KILL_RANK / KILL_STEP / KILL_MARKER: that rank SIGKILLs itself at its KILL_STEP-th loss, once.
- MATRIX_PACE: seconds each loss waits (a run long enough to be signalled mid-way).
"""

from __future__ import annotations

import os
import time

import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from ddptrain import Task
from ddptrain.tasks.regression import regression_data

from data_tasks import NumberStream, SquareShares, TinyLM, _next_token_loss, _stream_task
from ddptrain_test_tasks import PlainDataset
from kills import _on_step, killable

SIZES = {"map_even": 256, "map_uneven": 250, "stream_even": 256, "stream_uneven": 240, "token_file": 256}
SEQ_LEN = 16


def _model(seed: int) -> torch.nn.Module:
    """Two blocks (FSDP shards each), no dropout (one rank and two must be comparable)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _build(cfg) -> Task:
    data = os.environ["MATRIX_DATA"]
    if data.startswith("map_"):
        inputs, targets = regression_data(cfg.seed, SIZES[data]).tensors
        return Task(model=_model(cfg.seed), train_set=PlainDataset(TensorDataset(inputs, targets)), loss_fn=F.mse_loss,
                    defaults={"lr": 0.05, "optimizer": "sgd", "momentum": 0.9})
    if data == "stream_even":
        task = _stream_task(cfg, NumberStream(SIZES[data], cfg.seed))
    elif data == "stream_uneven":
        task = _stream_task(cfg, SquareShares(SIZES[data]))
    elif data == "token_file":
        from ddptrain.data import TokenFile

        torch.manual_seed(cfg.seed)
        return Task(model=TinyLM(vocab=64, width=16), train_set=TokenFile(os.environ["TOKEN_FILE"], seq_len=SEQ_LEN),
                    loss_fn=_next_token_loss, defaults={"lr": 0.1, "optimizer": "sgd", "momentum": 0.9},
                    tokens_per_sample=SEQ_LEN)
    else:
        raise ValueError(f"MATRIX_DATA={data!r}")
    task.model = _model(cfg.seed)
    task.defaults = {"lr": 0.05, "optimizer": "sgd", "momentum": 0.9}
    return task


def _paced(cfg) -> Task:
    task = _build(cfg)
    pause = float(os.environ.get("MATRIX_PACE", "0"))
    return _on_step(task, lambda n: time.sleep(pause)) if pause else task


matrix = killable(_paced)


def write_token_file(path, windows: int = SIZES["token_file"]) -> None:
    """The token file of the ``token_file`` shape: ids below 64, ``windows`` windows of 16."""
    import numpy as np

    np.random.default_rng(0).integers(0, 64, size=windows * SEQ_LEN + 1, dtype=np.uint16).tofile(path)
