"""What one step's batch means for the layers: the rows reordered (decodes first), each row's blocks and
positions, and the masks the Python path needs."""

from __future__ import annotations

import numpy as np

from fdcore.models import cpu_env  # noqa: F401  (before paddle: math-library settings)

# isort: split
import paddle

from fdcore.core.batch import BatchInput
from fdcore.models.kv_cache import PagedKVCache


class StepPlan:
    """Index arrays for one step, built once in numpy (decodes first, then prefills)."""

    def __init__(
        self,
        batch: BatchInput,
        order: list[int],
        cache: PagedKVCache,
        masks: bool = True,
        windows: tuple[int, ...] = (0,),
    ):
        tokens, positions, write, last, self.prefills = [], [], [], [], []
        self._rows = []  # (block table, first position, token count) per sequence, in row order
        self._row_arrays = None
        row, size = 0, cache.block_size
        for s in order:
            ids, start = batch.token_ids[s], batch.start_positions[s]
            end = start + len(ids)
            tokens.extend(ids)
            positions.extend(range(start, end))
            self._rows.append((batch.block_tables[s], start, len(ids)))
            if len(ids) == 1:  # a decode: its one slot, without numpy's per-call overhead
                write.append((batch.block_tables[s][start // size] * size + start % size,))
            else:
                write.append(cache.slots(batch.block_tables[s], start, end))
            if len(ids) > 1 and masks:  # (the paged kernel needs no masks)
                blocks = _blocks_for(batch.block_tables[s], end, cache.block_size)
                biases = {
                    w: paddle.to_tensor(_causal_bias(start, end, len(blocks) * cache.block_size, w)) for w in windows
                }
                self.prefills.append((row, row + len(ids), blocks, biases))
            row += len(ids)
            last.append(row - 1)
        self.token_ids = np.asarray(tokens, dtype=np.int64)
        self.positions = np.asarray(positions, dtype=np.int64)
        self.write_slots = np.fromiter((slot for part in write for slot in part), dtype=np.int64)
        self.last_rows = np.asarray(last, dtype=np.int64)
        self._counts = [len(batch.token_ids[s]) for s in order]
        decode = [s for s in order if len(batch.token_ids[s]) == 1]
        self.num_decode = len(decode)
        if decode and masks:
            self._plan_decode(batch, decode, cache.block_size, windows)

    def rows_of(self, place: int) -> tuple[int, int]:
        """The rows (first, end) of the ``place``-th sequence in row order."""
        end = int(self.last_rows[place]) + 1
        return end - self._counts[place], end

    def rope_lengths(self, batch: BatchInput, order: list[int]) -> np.ndarray:
        """Per row, the sequence length its rotary frequencies are for (dynamic scaling):
        max(position + 1, prompt length), or the end of the sequence's tokens in this step
        when the caller gave no prompt lengths (the same for a prompt prefilled whole)."""
        counts = [len(batch.token_ids[s]) for s in order]
        if batch.prompt_lengths is None:
            ends = [batch.start_positions[s] + n for s, n in zip(order, counts, strict=True)]
            return np.repeat(np.asarray(ends, dtype=np.int64), counts)
        prompts = np.repeat(np.asarray([batch.prompt_lengths[s] for s in order], dtype=np.int64), counts)
        return np.maximum(self.positions + 1, prompts)

    def row_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row: its sequence's block table (padded) and how many keys it sees (position + 1)."""
        if self._row_arrays is None:
            total = sum(count for _, _, count in self._rows)
            width = max(len(table) for table, _, _ in self._rows)
            tables = np.zeros((total, width), dtype=np.int64)
            lengths = np.empty(total, dtype=np.int64)
            row = 0
            for table, start, count in self._rows:
                tables[row : row + count, : len(table)] = table
                lengths[row : row + count] = np.arange(start + 1, start + count + 1)
                row += count
            self._row_arrays = (tables, lengths)
        return self._row_arrays

    def _plan_decode(self, batch, decode, block_size, windows) -> None:
        """Every decode sequence padded to the same number of blocks, the padding (and keys
        outside a sliding window) masked."""
        lengths = np.asarray([batch.start_positions[s] + 1 for s in decode])
        width = -(-int(lengths.max()) // block_size)
        blocks = np.zeros((len(decode), width), dtype=np.int64)
        for i, s in enumerate(decode):
            table = batch.block_tables[s][:width]
            blocks[i, : len(table)] = table
        self.decode_blocks = blocks.reshape(-1)
        self.decode_bias = {
            window: paddle.to_tensor(
                _attention_bias(lengths - 1, width * block_size, window).reshape(1, len(decode), 1, -1)
            )
            for window in windows
        }


def _blocks_for(block_table: list[int], length: int, block_size: int) -> np.ndarray:
    return np.asarray(block_table[: -(-length // block_size)], dtype=np.int64)


def _causal_bias(start: int, end: int, width: int, window: int = 0) -> np.ndarray:
    """[n, width] additive mask: new token i (at position start + i) sees keys 0 .. start + i
    (only the last ``window`` of them when window > 0)."""
    return _attention_bias(np.arange(start, end), width, window)


def _attention_bias(positions: np.ndarray, width: int, window: int) -> np.ndarray:
    """[len(positions), width] additive mask: a query at position p sees keys 0 .. p, or only
    p - window + 1 .. p when window > 0 (the paged kernel's rule)."""
    keys = np.arange(width)[None, :]
    queries = positions[:, None]
    seen = keys <= queries
    if window:
        seen &= keys > queries - window
    return np.where(seen, 0.0, -np.inf).astype(np.float32)
