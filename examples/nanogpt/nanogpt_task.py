import numpy as np

import ddptrain
from ddptrain.data import TokenFile

from model import GPT, GPTConfig


def task(cfg):
    """The model's own settings are task options: --task-opt n_layer=4 (config.json records them)."""
    block = cfg.task_option("block_size", 64)
    vocab = 1 + max(int(np.fromfile(name, dtype=np.uint16).max()) for name in ("train.bin", "val.bin"))
    model = GPT(GPTConfig(block_size=block, vocab_size=vocab, n_layer=cfg.task_option("n_layer", 2),
                          n_head=cfg.task_option("n_head", 2), n_embd=cfg.task_option("n_embd", 64),
                          dropout=cfg.task_option("dropout", 0.0)))

    def step_fn(model, batch):  # a micro-batch's mean loss
        inputs, targets = batch
        return model(inputs, targets)[1]

    def eval_fn(model, batch):  # sums: ddptrain adds every rank's and divides by the samples
        inputs, targets = batch
        return {"loss": model(inputs, targets)[1] * len(inputs), "samples": len(inputs)}

    def make_optimizer(params):  # nanoGPT's weight_decay is 0.1 unless --weight-decay says otherwise
        decay = 0.1 if cfg.weight_decay is None else cfg.weight_decay
        device_type = next(model.parameters()).device.type  # "cuda" on GPUs: nanoGPT's fused AdamW there
        return model.configure_optimizers(decay, cfg.hparam("lr"), cfg.adam_betas, device_type)

    return ddptrain.Task(model=model, train_set=TokenFile("train.bin", block), eval_set=TokenFile("val.bin", block),
                         step_fn=step_fn, eval_fn=eval_fn, make_optimizer=make_optimizer, tokens_per_sample=block)
