"""The model protocol: what carpool needs from a model, and nothing more.

A model has two halves that run in different processes:
- ``encode`` runs on the coordinator: text -> token ids (truncated to the model's window), so the
  coordinator knows each request's true length and the worker never tokenizes again;
- ``load`` and ``forward`` run on a worker, after any fork: ``forward`` gets one padded batch and
  returns one output per row: JSON-serialisable values, or a numpy array with one row per input
  (written straight from the array; float32 rows in their shortest float32 form, which reads back as
  the same float32 values: see :mod:`carpool.codec`).

Optionally, ``plain_ids = True`` says that ``encode`` gives lists of Python ints within int64, as the
built-in tokenizers do, and carpool skips checking each id. Without it each row is converted (numpy
integer arrays and tuples become lists of ints), and a row holding anything else (a float, an id past
int64) fails its own request at intake with ``InvalidInput``.

Optionally, ``count_tokens(texts) -> list[int]`` gives untruncated lengths; with it carpool can
reject over-long texts (``CARPOOL_TRUNCATE=false``) instead of truncating them.

Optionally, ``launch(input_ids, attention_mask)`` starts a batch on an asynchronous device and returns
at once with a function that waits for that batch and gives what ``forward`` would have (a CUDA
model queues its kernels and a non-blocking copy of the output to pinned host memory, and waits on
an event). A worker then starts the next batch before it collects this one, so the device has
work queued behind the running batch while the worker's thread handles the previous batch's outputs.
Leave it out (or ``None``) where ``forward`` computes synchronously, as on a CPU.

Write your own by implementing :class:`BatchModel` and set ``CARPOOL_MODEL=package.module:ClassName``.
The class is built with no arguments; keep heavy imports (torch) inside ``load``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


@runtime_checkable
class BatchModel(Protocol):
    #: longest input in tokens, special tokens included; ``encode`` truncates to it
    max_length: int
    #: token id used for padding
    pad_id: int
    #: whether ``forward`` reads token ids (False: only the attention mask, e.g. the null model)
    needs_token_ids: bool

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, truncated to ``max_length``. Called on the coordinator."""
        ...

    def load(self, device: str, *, autocast_bf16: bool = False) -> None:
        """Load weights onto ``device`` ("cpu" or "cuda"). Called once per worker process.

        ``autocast_bf16`` (``CARPOOL_AUTOCAST_BF16``): run ``forward`` under bfloat16 autocast on
        CUDA; a model that cannot, or a CPU device, ignores it.
        """
        ...

    def forward(
        self, input_ids: npt.NDArray[np.int64], attention_mask: npt.NDArray[np.int64]
    ) -> Sequence[Any] | npt.NDArray[Any]:
        """Outputs for a padded batch (rows x padded length); one output per row, same order."""
        ...
