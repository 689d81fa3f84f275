"""Data: the embedded corpus, byte-level tokenizer, memory-mapped token files and a resumable sampler."""

from crosstrain.data.batch import TokenBatch
from crosstrain.data.dataset import TokenDataset, build_dataset
from crosstrain.data.sampler import DistributedBatchSampler
from crosstrain.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "DistributedBatchSampler", "TokenBatch", "TokenDataset", "build_dataset"]
