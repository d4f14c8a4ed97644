"""Your own Dataset class, with a transform, through a DataLoader with workers: a small CNN
with BatchNorm on the 8x8 digits, randomly shifted by a pad-and-crop augmentation.

    cd examples && ddptrain train --task image_classifier:cnn_task --workers 2 --max-epochs 5
    python examples/image_classifier.py --workers 2        # the same through ddptrain.fit

The augmentation draws each sample's shift from (seed, epoch, index), not from a worker's
random state, so a run killed and resumed crops exactly as an uninterrupted one, whatever
worker serves which sample; ddptrain calls ``set_epoch`` on the data set before each epoch.
"""

import argparse

import torch
from torch.nn import functional as F
from torch.utils.data import Dataset

import ddptrain
from ddptrain.tasks import load_digits, stratified_split

PAD = 1  # pixels of padding before an 8x8 crop: shifts of up to one pixel each way


class Digits(Dataset):
    """The digits as dicts {"image": 1x8x8, "label": int}, randomly shifted when ``augment``."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, seed: int, augment: bool) -> None:
        self.images, self.labels = images.view(-1, 1, 8, 8), labels
        self.seed, self.augment, self.epoch = seed, augment, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        image = self.images[index]
        if self.augment:
            generator = torch.Generator().manual_seed(hash((self.seed, self.epoch, index)) % 2**62)
            dy, dx = torch.randint(0, 2 * PAD + 1, (2,), generator=generator).tolist()
            image = F.pad(image, (PAD, PAD, PAD, PAD))[:, dy:dy + 8, dx:dx + 8]
        return {"image": image, "label": self.labels[index]}


def collate(samples: list[dict]) -> dict:
    return {"image": torch.stack([s["image"] for s in samples]),
            "label": torch.stack([s["label"] for s in samples])}


def step(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["image"]), batch["label"])


@torch.no_grad()
def evaluate(model: torch.nn.Module, batch: dict) -> dict:
    logits = model(batch["image"])
    return {"loss": F.cross_entropy(logits, batch["label"], reduction="sum"),
            "accuracy": (logits.argmax(dim=1) == batch["label"]).sum(), "samples": len(batch["label"])}


def cnn_task(cfg: ddptrain.RunConfig) -> ddptrain.Task:
    images, labels = load_digits()
    train, test = stratified_split(labels, cfg.seed)
    images, labels = torch.from_numpy(images), torch.from_numpy(labels)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten(), torch.nn.Linear(128, 10),
    )
    return ddptrain.Task(
        model=model,
        train_set=Digits(images[train], labels[train], cfg.seed, augment=True),
        eval_set=Digits(images[test], labels[test], cfg.seed, augment=False),
        collate_fn=collate, step_fn=step, eval_fn=evaluate,
        defaults={"optimizer": "adamw", "lr": 3e-3},
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a small CNN with BatchNorm, trained with ddptrain.fit")
    parser.add_argument("--max_epochs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--run_dir", default=None)
    args = parser.parse_args()
    summary = ddptrain.fit(cnn_task, max_epochs=args.max_epochs, workers=args.workers, run_dir=args.run_dir)
    if summary:
        print(f"test accuracy {summary['eval_accuracy']:.3f}")
