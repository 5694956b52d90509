"""The loader's part of sequence parallelism (anyaccel/strategies/nd/sequence/loader.py), rank by rank without a
process group: what each sp rank keeps of a batch, and which padding masks are accepted."""

import pytest
import torch
from torch.utils.data import DataLoader

from anyaccel.data import prepare_data_loader
from anyaccel.strategies.nd.sequence.loader import SequenceSlicer, sliced_feed


def _batch(rows=2, length=8):
    ids = torch.arange(rows * length).view(rows, length)
    return {"input_ids": ids, "labels": ids + 100, "attention_mask": torch.ones_like(ids),
            "sample_weight": torch.ones(rows), "pixel_like": torch.zeros(rows, 3)}


def test_each_rank_keeps_its_contiguous_slice_of_every_sequence_tensor():
    batch = _batch()
    parts = [SequenceSlicer(r, 2)(batch) for r in range(2)]
    for key in ("input_ids", "labels", "attention_mask"):
        assert torch.equal(torch.cat([p[key] for p in parts], dim=1), batch[key])  # rank order = sequence order
    assert parts[1]["input_ids"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    for p in parts:  # not sequence-shaped: passed as they are
        assert p["sample_weight"] is batch["sample_weight"] and p["pixel_like"] is batch["pixel_like"]
        assert list(p) == list(batch)  # no key added or removed: model(**batch) keeps working
    with pytest.raises(KeyError, match="drop the loss aggregation over sp ranks"):  # an ALST loop, migrated
        parts[0]["shift_labels"]
    with pytest.raises(KeyError, match="'other'"):
        parts[0]["other"]


def test_tuple_and_tensor_batches_cut_every_sequence_tensor():
    tokens, targets = torch.arange(12).view(2, 6), torch.arange(12).view(2, 6) * 10
    first, second, weight = SequenceSlicer(2, 3)((tokens, targets, torch.ones(2)))
    assert first.tolist() == [[4, 5], [10, 11]] and second.tolist() == [[40, 50], [100, 110]] and weight.shape == (2,)
    assert SequenceSlicer(0, 3)(tokens).tolist() == [[0, 1], [6, 7]]
    with pytest.raises(ValueError, match=r"different lengths along dimension 1 \(\[4, 6\]\)"):
        SequenceSlicer(0, 2)((tokens, torch.zeros(2, 4)))


def test_a_length_that_sp_size_does_not_divide_or_that_differs_from_the_declared_one_is_refused():
    with pytest.raises(ValueError, match=r"sequence length 8 is not divisible by sp_size=3; pad the batches to a "
                                         r"multiple of 3 \(a transformers collator's pad_to_multiple_of=3"):
        SequenceSlicer(0, 3)(_batch())
    with pytest.raises(ValueError, match="sequence length 8, but sp_handler declares sp_seq_length=16"):
        SequenceSlicer(0, 2, seq_length=16)(_batch())
    assert SequenceSlicer(0, 2, seq_length=8)(_batch())["input_ids"].shape == (2, 4)


def test_right_padding_whose_labels_are_ignored_becomes_ones_and_other_padding_is_refused():
    batch = _batch()
    batch["attention_mask"][0, -3:] = 0
    with pytest.raises(ValueError, match=r"right padding is accepted only when its labels are ignored \(-100\)"):
        SequenceSlicer(1, 2)(batch)
    batch["labels"][0, -3:] = -100
    cut = SequenceSlicer(1, 2)(batch)
    assert cut["attention_mask"].tolist() == [[1] * 4] * 2  # dropping it changes no counted token
    assert cut["labels"][0].tolist() == [104, -100, -100, -100]
    batch["attention_mask"][1, :2] = 0  # left padding in row 1
    with pytest.raises(ValueError, match=r"padding before real tokens \(left padding, or holes\).*padding_side='right'"):
        SequenceSlicer(0, 2)(batch)
    batch["attention_mask"] = torch.ones(2, 1, 8, 8)
    with pytest.raises(ValueError, match=r"attention_mask of shape \(2, 1, 8, 8\) is not a \(batch, 8\) padding mask"):
        SequenceSlicer(0, 2)(batch)


def test_a_transformers_batch_encoding_keeps_its_type():
    transformers = pytest.importorskip("transformers")
    cut = SequenceSlicer(0, 2)(transformers.BatchEncoding({"input_ids": torch.zeros(1, 4, dtype=torch.long)}))
    assert isinstance(cut, transformers.BatchEncoding) and cut["input_ids"].shape == (1, 2)


def test_a_prepared_loader_with_the_sliced_feed_yields_slices_of_the_original_batches():
    data = [{"input_ids": torch.arange(8) + 8 * i} for i in range(4)]
    loader = prepare_data_loader(DataLoader(data, batch_size=2), torch.device("cpu"), 1, 0,
                                 feed=sliced_feed(SequenceSlicer(1, 2), None))
    assert [b["input_ids"].tolist() for b in loader] == [[[4, 5, 6, 7], [12, 13, 14, 15]],
                                                        [[20, 21, 22, 23], [28, 29, 30, 31]]]


def test_packed_sequences_are_refused_and_global_positions_pass():
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "position_ids": torch.arange(8)[None]}
    assert SequenceSlicer(1, 2)(batch)["position_ids"].tolist() == [[4, 5, 6, 7]]  # global values kept
    batch["position_ids"] = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])  # two documents in one row
    with pytest.raises(ValueError, match=r"position_ids restart inside a row \(packed sequences\)"):
        SequenceSlicer(0, 2)(batch)
