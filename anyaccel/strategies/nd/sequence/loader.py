"""The loader's part of sequence parallelism: every ``sp`` rank of a data-parallel group reads the
same batch (the loader shards by data-parallel rank) and keeps its slice of every sequence.

Rank ``r`` of ``N`` keeps positions ``[r * L/N, (r+1) * L/N)`` of every tensor that has the
sequence dimension (dimension 1 of length ``L``). What is cut:

* a mapping batch (transformers' ``input_ids``, ``labels``, ``position_ids``, ``token_type_ids``,
  ...): every tensor of two or more dimensions whose dimension 1 has the length of
  ``input_ids`` (or ``inputs_embeds``, else the first such tensor); other values pass as they are.
  Labels stay unshifted: the model (or ``accelerator.causal_lm_loss``) shifts them across the
  slice border. Position ids given in the batch keep their global values; where there are none,
  the prepared transformers model adds this slice's global positions, so rotary embeddings see
  what one process sees;
* a tuple, list or tensor batch: every tensor of two or more dimensions (they must share the
  length of dimension 1).

Position ids that restart inside a row (packed sequences) are refused: attention under ``sp`` is
causal over the whole row and would let one document see the one before it.

``attention_mask``: attention under ``sp`` is causal over the whole sequence, so a mask is kept
only where dropping it changes no counted token: all ones, or right padding (no 1 after a 0 in a
row) whose ``labels`` are ``ignore_index`` at the padding. Such a mask is replaced by ones (the
model then drops it), or kept as it is with ``keep_padding`` (under expert parallelism: the
router statistics of the auxiliary loss leave padding out; a prepared transformers model drops
it for attention, a model of yours gets its zeros); any other mask (left padding, holes) is a
``ValueError`` saying what to do.

``L`` must be divisible by ``N`` (pad to a multiple: ``pad_to_multiple_of`` in a transformers
collator), and equal to ``seq_length`` when one is declared (``sp_handler``'s ``sp_seq_length``
with ``sp_seq_length_is_variable=False``). Local: slicing communicates nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Iterator, Mapping, Optional

import torch

from .ulysses import check_positions

__all__ = ["SequenceSlicer", "sliced_feed"]

_LENGTH_KEYS = ("input_ids", "inputs_embeds")


class SequenceSlicer:
    """Cut batches into this rank's slice of the sequence (see the module's docstring): rank
    ``rank`` of ``size`` ``sp`` ranks. Local."""

    def __init__(self, rank: int, size: int, seq_length: Optional[int] = None, ignore_index: int = -100,
                 keep_padding: bool = False):
        self.rank, self.size, self.seq_length, self.ignore_index = rank, size, seq_length, ignore_index
        self.keep_padding = keep_padding  # right padding kept as it is (for the experts' router statistics)

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            return self._mapping(batch)
        if isinstance(batch, torch.Tensor):
            return self._cut(batch, self._length([batch], "the batch")) if batch.dim() >= 2 else batch
        if isinstance(batch, (tuple, list)):
            tensors = [t for t in batch if isinstance(t, torch.Tensor) and t.dim() >= 2]
            if not tensors:
                return batch
            length = self._length(tensors, "the batch's tensors")
            items = [self._cut(t, length) if isinstance(t, torch.Tensor) and t.dim() >= 2 else t for t in batch]
            return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
        raise TypeError(f"sequence parallelism cuts tensors, tuples/lists of tensors or mappings of them along "
                        f"dimension 1; this batch is a {type(batch).__name__}")

    # ---- pieces ------------------------------------------------------------------------------
    def _length(self, tensors: Iterable[torch.Tensor], what: str) -> int:
        lengths = {t.shape[1] for t in tensors}
        if len(lengths) != 1:
            raise ValueError(f"sequence parallelism: {what} have different lengths along dimension 1 "
                             f"({sorted(lengths)}); a tuple batch must hold sequences of one length (use a mapping "
                             "with input_ids to cut only the tensors of that length)")
        return self._checked(lengths.pop())

    def _checked(self, length: int) -> int:
        if self.seq_length is not None and length != self.seq_length:
            raise ValueError(f"sequence parallelism: a batch has sequence length {length}, but sp_handler declares "
                             f"sp_seq_length={self.seq_length} with sp_seq_length_is_variable=False; pad or cut the "
                             "batches to that length, or declare sp_seq_length_is_variable=True")
        if length % self.size:
            raise ValueError(f"sequence parallelism: sequence length {length} is not divisible by sp_size={self.size}; "
                             f"pad the batches to a multiple of {self.size} (a transformers collator's "
                             f"pad_to_multiple_of={self.size}; right padding with labels -100 changes no loss)")
        return length

    def _cut(self, t: torch.Tensor, length: int) -> torch.Tensor:
        part = length // self.size
        return t[:, self.rank * part:(self.rank + 1) * part]

    def _mapping(self, batch: Mapping[str, Any]) -> Any:
        key = next((k for k in _LENGTH_KEYS if isinstance(batch.get(k), torch.Tensor)), None)
        if key is None:
            key = next((k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() >= 2), None)
            if key is None:
                return batch
        length = self._checked(batch[key].shape[1])
        out = {}
        for k, v in batch.items():
            if k == "attention_mask" and isinstance(v, torch.Tensor):
                v = self._mask(v, batch.get("labels"), length)
            if k == "position_ids" and isinstance(v, torch.Tensor):
                check_positions(v)
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == length:
                v = self._cut(v, length)
            out[k] = v
        if type(batch) is dict:
            return _SequenceBatch(out)
        try:
            return type(batch)(out)  # type: ignore[call-arg]  # transformers' BatchEncoding, OrderedDict, ...
        except TypeError:
            return out

    def _mask(self, mask: torch.Tensor, labels: Any, length: int) -> torch.Tensor:
        """All ones, or right padding whose labels are ignored: replaced by ones (kept as it is with
        ``keep_padding``: the prepared model drops it for attention); else refused."""
        if mask.dim() != 2 or mask.shape[1] != length:
            raise ValueError(f"sequence parallelism: attention_mask of shape {tuple(mask.shape)} is not a (batch, "
                             f"{length}) padding mask; under sp_size > 1 attention is causal over the whole sequence, "
                             "so leave custom masks out")
        keep = mask.bool()
        if bool(keep.all()):
            return mask
        # right padding: once a row has a 0, it has no 1 after it
        if bool((keep[:, 1:] & ~keep[:, :-1]).any()):
            raise ValueError("sequence parallelism: attention_mask has padding before real tokens (left padding, or "
                             "holes); under sp_size > 1 attention is causal over the whole sequence and cannot skip "
                             "them. Pad on the right (tokenizer padding_side='right') with labels -100 at the padding, "
                             "or pack sequences without padding")
        if isinstance(labels, torch.Tensor) and labels.shape == mask.shape:
            if bool((labels[~keep] != self.ignore_index).any()):
                raise ValueError(f"sequence parallelism: right padding is accepted only when its labels are ignored "
                                 f"({self.ignore_index}): then no counted token attends to padding, mask or not. Set "
                                 f"labels to {self.ignore_index} where attention_mask is 0 (transformers' "
                                 "DataCollatorForLanguageModeling does)")
        return mask if self.keep_padding else torch.ones_like(mask)


class _SequenceBatch(Dict[str, Any]):
    """A plain dict, except that asking for ``shift_labels`` (which Accelerate's DeepSpeed adapter
    adds and its ALST loop reads to average the loss by hand) says why it is not there."""

    def __missing__(self, key: Any) -> Any:
        if key == "shift_labels":
            raise KeyError("shift_labels: under anyaccel's sequence parallelism the prepared model shifts labels "
                           "across the slice border itself and returns the loss of the whole global batch (the same "
                           "on every rank); drop the loss aggregation over sp ranks (Accelerate's ALST loop) and use "
                           "model(**batch).loss as it is (docs/guides/sequence.md)")
        raise KeyError(key)


def sliced_feed(slicer: Callable[[Any], Any],
                feed: Optional[Callable[[Iterable[Any]], Iterable[Any]]]) -> Callable[[Iterable[Any]], Iterable[Any]]:
    """A loader feed that cuts each host batch with ``slicer`` before ``feed`` (the backend's,
    which takes batches to the device; None: batches stay where they are). Local."""

    def cut_then_feed(batches: Iterable[Any]) -> Iterable[Any]:
        cut: Iterator[Any] = map(slicer, batches)
        return feed(cut) if feed is not None else cut

    return cut_then_feed
