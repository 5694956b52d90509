"""``anyaccel.test_utils.training``: the tiny regression problem of Accelerate's tests, and the
MRPC loaders its example scripts use under ``TESTING_MOCKED_DATALOADERS=1``.

``RegressionDataset(a, b, length, seed)`` draws ``x ~ N(0, 1)`` and ``y = a*x + b + N(0, 0.1)``
with numpy's ``default_rng(seed)`` (the same numbers as Accelerate's for the same arguments), items
``{"x": float32, "y": float32}``; ``RegressionModel(a, b)`` predicts ``x * a + b`` with two scalar
parameters. Local.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..environment import DistributedType

__all__ = ["RegressionDataset", "RegressionModel", "mocked_dataloaders", "mocked_dataloaders_for_autoregressive_models"]

#: Accelerate's sample of GLUE MRPC (tests/test_samples/MRPC/{train,dev}.csv in its repository),
#: read relative to the working directory as Accelerate's helpers read it
MRPC_FILES = {"train": "tests/test_samples/MRPC/train.csv", "validation": "tests/test_samples/MRPC/dev.csv"}


class RegressionDataset:
    """``length`` points of ``y = a*x + b`` plus noise (standard deviation 0.1), drawn from numpy's
    ``default_rng(seed)``."""

    def __init__(self, a: float = 2, b: float = 3, length: int = 64, seed: Optional[int] = None):
        rng = np.random.default_rng(seed)
        self.length = length
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = a * self.x + b + rng.normal(scale=0.1, size=(length,)).astype(np.float32)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i]}


class RegressionModel(torch.nn.Module):
    """``x * a + b`` with scalar parameters ``a`` and ``b``; prints the dtypes of its first call
    (as Accelerate's, whose tests read that line)."""

    def __init__(self, a: float = 0, b: float = 0, double_output: bool = False):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a).float())
        self.b = torch.nn.Parameter(torch.tensor(b).float())
        self.first_batch = True

    def forward(self, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.first_batch:
            print(f"Model dtype: {self.a.dtype}, {self.b.dtype}. Input dtype: {x.dtype}")  # type: ignore[union-attr]
            self.first_batch = False
        return x * self.a + self.b  # type: ignore[operator]


def mocked_dataloaders(accelerator: Any, batch_size: int = 16) -> Tuple[DataLoader, DataLoader]:
    """Train and validation loaders over Accelerate's MRPC sample, tokenized with
    ``bert-base-cased`` (needs ``datasets``, ``transformers`` and that tokenizer, from the Hub or
    its cache). Train: shuffled, batch 2; validation: batch 1 — ``batch_size`` is ignored, as in
    Accelerate's."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained("bert-base-cased")
    datasets = load_dataset("csv", data_files=MRPC_FILES)
    label_to_id = {v: i for i, v in enumerate(datasets["train"].unique("label"))}

    def tokenize(examples: Dict[str, Any]) -> Any:
        outputs = tokenizer(examples["sentence1"], examples["sentence2"], truncation=True, max_length=None,
                            padding="max_length")
        if "label" in examples:
            outputs["labels"] = [label_to_id[label] for label in examples["label"]]
        return outputs

    tokenized = datasets.map(tokenize, batched=True, remove_columns=["sentence1", "sentence2", "label"])

    def collate(examples: Any) -> Any:
        if accelerator.distributed_type == DistributedType.XLA:
            return tokenizer.pad(examples, padding="max_length", max_length=128, return_tensors="pt")
        return tokenizer.pad(examples, padding="longest", return_tensors="pt")

    return (DataLoader(tokenized["train"], shuffle=True, collate_fn=collate, batch_size=2),
            DataLoader(tokenized["validation"], shuffle=False, collate_fn=collate, batch_size=1))


def mocked_dataloaders_for_autoregressive_models(accelerator: Any, batch_size: int = 16) -> Tuple[DataLoader, DataLoader]:
    """Causal-LM loaders over the first sentences of Accelerate's MRPC sample, tokenized with
    ``HuggingFaceTB/SmolLM-360M`` (labels are the inputs shifted by one, padding masked with
    -100); batch 2 (train) and 1 (validation), unshuffled."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM-360M")
    tokenizer.pad_token = tokenizer.eos_token
    datasets = load_dataset("csv", data_files=MRPC_FILES)

    def tokenize(examples: Dict[str, Any]) -> Any:
        return tokenizer(examples["sentence1"], truncation=True, max_length=None, return_attention_mask=False)

    with accelerator.main_process_first():
        tokenized = datasets.map(tokenize, batched=True, remove_columns=["sentence1", "sentence2", "label"])

    def collate(examples: Any) -> Any:
        longest = 128 if accelerator.distributed_type == DistributedType.XLA else \
            max(len(e["input_ids"]) for e in examples)
        multiple = 16 if accelerator.mixed_precision == "fp8" else None if accelerator.mixed_precision == "no" else 8
        batch = tokenizer.pad(examples, padding="max_length", max_length=longest + 1, pad_to_multiple_of=multiple,
                              return_tensors="pt")
        batch["labels"] = batch["input_ids"][:, 1:]
        batch["input_ids"] = batch["input_ids"][:, :-1]
        if "attention_mask" in batch:
            batch["attention_mask"] = batch["attention_mask"][:, :-1]
        batch["labels"] = torch.where(batch["labels"] == tokenizer.pad_token_id, -100, batch["labels"])
        return batch

    return (DataLoader(tokenized["train"], shuffle=False, collate_fn=collate, batch_size=2),
            DataLoader(tokenized["validation"], shuffle=False, collate_fn=collate, batch_size=1))
