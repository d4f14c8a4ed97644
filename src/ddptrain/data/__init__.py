"""Which samples each rank trains on, and how batches reach the device.

- sampling.py: a map-style set's samples at each optimizer step (``StepSampler``), exact on
  any data-set size;
- batches.py: batches on the device, by an in-memory fast path or a DataLoader
  (``TrainBatches``, ``EvalBatches``);
- streams.py: iterable sets, shared among ranks and workers, agreed step by step, resumed
  exactly (``StreamBatches``);
- token_file.py: ``TokenFile``, a memory-mapped file of token ids (nanoGPT's ``.bin``);
- training.py: which of them a run's training set takes (``training_batches``).

docs/data.md says which to use when.
"""

from .batches import EvalBatches, TrainBatches, eval_subset, to_device
from .sampling import MicroBatch, StepSampler
from .streams import StreamBatches, is_stream
from .token_file import TokenFile
from .training import training_batches

__all__ = ["EvalBatches", "MicroBatch", "StepSampler", "StreamBatches", "TokenFile", "TrainBatches", "eval_subset",
           "is_stream", "to_device", "training_batches"]
