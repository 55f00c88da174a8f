"""Batches prepared ahead: the next iterations' micro-batches are gathered on a background thread.

Which samples an iteration trains on is a pure function of (iteration, first sample, batch size, seqlen): the
"key". The training loop asks for its key with `get`; meanwhile the Prefetcher has already loaded the keys it
guessed would come next (schedule.Schedule.next_key: batch-size ramp-up, curriculum, skipped iterations). A
wrong guess (a resume, a rollback, a plan changed under it) costs one synchronous load, never a wrong batch: a
batch is only ever handed out for exactly the key it was loaded for, so the sample order and bit-exact resume
do not depend on the prefetching at all.

The gather itself (GPTDataset.gather) is compiled and releases the GIL, so the thread runs beside the training
step. On CUDA the host buffer is pinned and the copy to the device is non-blocking.
"""
import collections
import queue
import threading
import weakref
from concurrent.futures import Future

import numpy as np
import torch


def sample_indices(first_sample: int, num_micro_batches: int, micro_batch_size: int, dp_rank: int, dp_size: int):
    """[num_micro_batches, micro_batch_size] sample indices of this DP rank's share of the global batch of
    num_micro_batches * micro_batch_size * dp_size samples from first_sample, in Megatron's order: micro-batch k
    takes the samples k*mbs*dp + dp_rank*mbs + [0, mbs)."""
    k = np.arange(num_micro_batches, dtype=np.int64)[:, None]
    return first_sample + k * micro_batch_size * dp_size + dp_rank * micro_batch_size + np.arange(micro_batch_size)


def load_tokens(dataset, first_sample, num_micro_batches, seqlen, micro_batch_size, dp_rank, dp_size,
                pin_memory=False):
    """This rank's micro-batches as one int64 host tensor [num_micro_batches, micro_batch_size, seqlen + 1]:
    the first seqlen+1 tokens of each sample (inputs are [:-1], labels [1:]), pinned for a CUDA device."""
    index = sample_indices(first_sample, num_micro_batches, micro_batch_size, dp_rank, dp_size)
    tokens = torch.empty((*index.shape, seqlen + 1), dtype=torch.int64, pin_memory=pin_memory)
    dataset.gather(index.reshape(-1), tokens.numpy().reshape(index.size, seqlen + 1))
    return tokens


def to_device(tokens: torch.Tensor, device) -> list:
    """[(inputs, labels)] per micro-batch: one (non-blocking, from pinned memory) copy, then views."""
    tokens = tokens.to(device, non_blocking=True)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


class Prefetcher:
    """Runs load(key) on a daemon thread for the `depth` keys that next_key guesses will follow the last one
    asked for. get(key) returns load(key), re-raising its exception if it failed; close() stops the thread
    (so does dropping the Prefetcher). next_key(key) returns None past the end of training."""

    def __init__(self, load, next_key, depth: int = 2):
        self._next_key, self._depth = next_key, depth
        self._pending = collections.deque()  # (key, Future), in the order guessed
        self._requests = queue.SimpleQueue()
        # The thread holds only the queue and `load`, not self: dropping the Prefetcher ends it (finalize).
        thread = threading.Thread(target=_serve, args=(self._requests, load), name="batch-prefetch", daemon=True)
        thread.start()
        self._load, self.thread = load, thread
        self._finalizer = weakref.finalize(self, self._requests.put, None)

    def get(self, key):
        future = None
        while self._pending:
            guessed, f = self._pending.popleft()
            if guessed == key:
                future = f
                break
            f.cancel()  # a guess that did not come true (skipped over or superseded)
        if future is None:
            for _, f in self._pending:
                f.cancel()
            self._pending.clear()
        last = self._pending[-1][0] if self._pending else key
        while len(self._pending) < self._depth and (last := self._next_key(last)) is not None:
            f = Future()
            self._requests.put((last, f))
            self._pending.append((last, f))
        return future.result() if future is not None else self._load(key)

    def close(self):
        for _, f in self._pending:
            f.cancel()
        self._pending.clear()
        self._finalizer()
        self.thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _serve(requests, load):
    while (request := requests.get()) is not None:
        key, future = request
        if not future.set_running_or_notify_cancel():
            continue  # cancelled while queued
        try:
            future.set_result(load(key))
        except BaseException as e:  # handed to whoever asks for this key (nobody, for a guess past the end)
            future.set_exception(e)
